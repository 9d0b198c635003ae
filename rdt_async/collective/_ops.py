"""The collectives over RDT objects, as a caller (driver or any actor) asks for them.

Each verb checks (`_checks`), then builds one typed part per member (`_messages`) and
runs them (`_launch`); the members do the work (`_member`). The verbs' ObjectRefs are
the members' answers: each one's value is the RDTObject its member produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _io
from .._errors import CollectiveGroupError
from .._object import RDTObject
from ..transports import _registry
from ._checks import (
    Holder,
    check_avg,
    check_covered,
    check_distinct,
    check_divisible,
    check_inplace,
    check_names,
    check_op,
    check_reducible,
    check_values,
    holder_of,
    member_handle,
    pick_group,
    resolve_all,
)
from ._groups import CollectiveGroup
from ._launch import Calls, launch
from ._messages import Allgather, Allreduce, Broadcast, Part, ReduceScatter
from ._twins import blocking_twin


async def allreduce_async(
    refs: Sequence[Any],
    /,
    *,
    op: str = "sum",
    group: CollectiveGroup | str | None = None,
    inplace: bool = False,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `allreduce`; never blocks the loop.

    Cancelling it stops the wait, not the collective: the members finish it and the
    results are dropped.
    """
    check_op(op)
    return await _io.start(_over_refs(Allreduce, refs, group, tensor_transport, op=op, inplace=inplace))


@blocking_twin(allreduce_async)
def allreduce(
    refs: Sequence[Any],
    /,
    *,
    op: str = "sum",
    group: CollectiveGroup | str | None = None,
    inplace: bool = False,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Reduce the values of `refs` over their holders; return one new ref per holder, in order.

    `refs[i]` (an ObjectRef or RDTObject) is held by a different member of one collective
    group, and the refs cover the group; the group is found from the refs, or named by
    `group`. Every value has the same tensor shapes and dtypes, under the same names in
    one order (non-tensor leaves may differ; each result keeps its holder's). `op` is one
    of sum, prod, min, max, avg (avg needs floating-point tensors). All tensors of one
    dtype go in one collective. The inputs stay untouched unless `inplace=True`, which
    reduces into them (inputs returned over the group's own transport). The new objects
    use `tensor_transport`, by default their holder's input's.

    Blocking (driver, sync actors); use `allreduce_async` on an event loop.
    Raises: CollectiveGroupError (holders not covering one group, one holder twice, a
    broken group), ValueError (mismatched shapes, dtypes or names, a bad op, a dtype or
    op the backend does not reduce, `inplace=True` over another transport than the
    group's, no refs), PeerDiedError (a member died: the group is broken), ObjectFreedError.
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


async def reduce_scatter_async(
    refs: Sequence[Any],
    /,
    *,
    op: str = "sum",
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `reduce_scatter`; never blocks the loop."""
    check_op(op)
    return await _io.start(_over_refs(ReduceScatter, refs, group, tensor_transport, op=op))


@blocking_twin(reduce_scatter_async)
def reduce_scatter(
    refs: Sequence[Any],
    /,
    *,
    op: str = "sum",
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Reduce the values of `refs` and scatter the result; return one new ref per holder.

    Every tensor is split along dim 0 into `len(refs)` equal chunks; the holder of
    `refs[i]` gets chunk i of the reduction, in the shape of its value (dim 0 divided).
    Otherwise as `allreduce`. Blocking; use `reduce_scatter_async` on an event loop.
    Raises: as `allreduce`; ValueError if a tensor's dim 0 does not divide evenly.
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


async def allgather_async(
    refs: Sequence[Any],
    /,
    *,
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `allgather`; never blocks the loop."""
    return await _io.start(_over_refs(Allgather, refs, group, tensor_transport))


@blocking_twin(allgather_async)
def allgather(
    refs: Sequence[Any],
    /,
    *,
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Gather the values of `refs` on every holder; return one new ref per holder, in order.

    Each new object's value is the list of all the values, in the order of `refs`.
    Otherwise as `allreduce`. Blocking; use `allgather_async` on an event loop.
    Raises: as `allreduce`.
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


async def broadcast_async(
    ref: Any,
    /,
    *,
    to: Sequence[Any],
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `broadcast`; never blocks the loop."""
    return await _io.start(_broadcast(ref, tuple(to), group, tensor_transport))


@blocking_twin(broadcast_async)
def broadcast(
    ref: Any,
    /,
    *,
    to: Sequence[Any],
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Copy the value of `ref` to the actors `to`; return one new ref per actor of `to`, in order.

    The holder of `ref` and the actors of `to` are members of one collective group. List
    the holder in `to` to get a new ref it holds too (its input stays as it is). Members
    of the group in neither take part without keeping anything; that needs `group` (the
    CollectiveGroup, whose handles name them). Blocking; use `broadcast_async` on a loop.
    Raises: CollectiveGroupError (actors outside the group, an actor twice in `to`), and
    what `allreduce` raises.
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


async def _over_refs(
    kind: type[Allreduce | ReduceScatter | Allgather],
    refs: Sequence[Any],
    group: Any,
    transport: str | None,
    *,
    op: str = "sum",
    inplace: bool = False,
) -> list[Any]:
    """Check, then run an allreduce, reduce_scatter or allgather. Runs on: caller (I/O loop)."""
    _check_transport(transport)
    verb = kind.verb
    objs = await resolve_all(verb, refs)
    holders = [await holder_of(verb, i, o) for i, o in enumerate(objs)]
    check_distinct(verb, holders, "refs", "held by")
    name, record = await pick_group(verb, objs, holders, group)
    check_covered(verb, name, record, {h.id for h in holders})
    check_values(verb, objs, holders, record["backend"])
    if kind is not Allgather:  # (a reduction: tensors paired by their place)
        check_names(verb, objs, holders)
        check_reducible(verb, objs[0], record["backend"], op)
    if inplace:
        check_inplace(verb, objs, holders, record["backend"])
    if op == "avg":
        check_avg(verb, objs[0])
    if kind is ReduceScatter:
        check_divisible(objs[0], len(objs))
    specs = tuple((s.shape, s.dtype) for s in objs[0].specs)
    order = tuple(record["actors"].index(h.id) for h in holders)  # the rank of each ref's holder
    calls: Calls = []
    for o, h, rank in zip(objs, holders, order):
        common: dict[str, Any] = {"group": name, "creation": record["creation"], "rank": rank, "size": len(order), "specs": specs,
                                  "obj_id": o.obj_id, "transport": transport or o.transport, "inline": _inline(o)}  # fmt: skip
        part: Part
        if kind is Allreduce:
            part = Allreduce(**common, skeleton=o.skeleton, op=op, inplace=inplace)
        elif kind is ReduceScatter:
            part = ReduceScatter(**common, skeleton=o.skeleton, order=order, op=op)
        else:
            part = Allgather(**common, skeletons=tuple(x.skeleton for x in objs), order=order)
        calls.append((h, part))
    return await launch(verb, name, calls)


async def _broadcast(ref: Any, to: tuple[Any, ...], group: Any, transport: str | None) -> list[Any]:
    """Check, then run a broadcast. Runs on: caller (I/O loop)."""
    _check_transport(transport)
    (obj,) = await resolve_all("broadcast", [ref])
    src = await holder_of("broadcast", 0, obj)
    receivers = [member_handle("broadcast", i, a) for i, a in enumerate(to)]
    if not receivers:
        raise ValueError("rdt.broadcast needs at least one actor in to=")
    check_distinct("broadcast", receivers, "to", "")
    everyone = {h.id: h for h in [src, *receivers]}
    if isinstance(group, CollectiveGroup):
        everyone.update((a._actor_id.hex(), Holder(a, a._actor_id.hex())) for a in group.actors)
    name, record = await pick_group("broadcast", [obj], list(everyone.values()), group)
    members = record["actors"]
    for h in everyone.values():
        if h.id not in members:
            raise CollectiveGroupError(f"rdt.broadcast: {h.label} (in to=) is not in collective group {name!r}")
    others = [r for r, a in enumerate(members) if a not in everyone]
    if others:
        who = ", ".join(f"rank {r} (actor {members[r][:8]})" for r in others)
        raise CollectiveGroupError(
            f"rdt.broadcast over group {name!r}: {who} must take part too; list them in to=, or pass "
            "group=<the CollectiveGroup> so that they take part without keeping a copy"
        )
    check_values("broadcast", [obj], [src], record["backend"])
    specs = tuple((s.shape, s.dtype) for s in obj.specs)
    root = members.index(src.id)
    keep = {h.id for h in receivers}
    calls: Calls = []
    for rank, aid in enumerate(members):
        source = aid == src.id
        part = Broadcast(group=name, creation=record["creation"], rank=rank, size=len(members), specs=specs,
                         obj_id=obj.obj_id if source else None, skeleton=obj.skeleton, root=root,
                         keep=aid in keep, transport=transport or obj.transport,
                         inline=_inline(obj) if source else None)  # fmt: skip
        calls.append((everyone[aid], part))
    refs = await launch("broadcast", name, calls)
    by_id = {h.id: r for (h, _), r in zip(calls, refs)}
    return [by_id[h.id] for h in receivers]


def _inline(obj: RDTObject) -> tuple[bytes, ...] | None:
    """The bytes of an object its producer keeps nothing for (see transports/inline.py)."""
    return obj.meta.get("inline") if obj.anchor is None else None


def _check_transport(transport: str | None) -> None:
    """A transport name that no transport has fails the call now, not after every member
    has reduced (and then the group, broken by the failed return)."""
    if transport is not None:
        _registry.check_name(transport)
