"""Collective groups: standalone Gloo/NCCL process groups over rdt.remote actors.

A group is made from the driver or any actor: its name is claimed in Ray's GCS (so a
name is unique in the cluster, and any process can read who holds which rank), rank 0
hosts the rendezvous store on its node's address, and every member joins concurrently
through its `rdt` concurrency group, so members busy in user methods still join.
Members keep their process group in the membership registry (`_membership.groups`);
transfers between members then go over it.

Declarative collectives (`allreduce`, `broadcast`, `allgather`, `reduce_scatter`) run
over RDT objects held by the members:

    caller (driver or any actor)                 each member (its `rdt` group, a thread)
    ------                                       ------
    resolve the refs, check holders, group,
    shapes and dtypes (no transfer: specs)
    rdt__group("collective", part) to all    ->  look the input up in the store, pack it
                                                 (one buffer per dtype), run one collective
                                                 per dtype on the group's pg, wait for it,
    wait for every member                    <-  produce() the result here: an RDTObject
    return the calls' ObjectRefs: each one's value is the RDTObject its member produced,
    so the new refs are held by the members and fetched like any other.

A member that dies mid-collective breaks the group: the caller raises PeerDiedError
and marks the group broken in every survivor (aborting their process group, so that
none waits for the dead one). Collectives on one group issued by one process run one
at a time, in order; issuing collectives on one group from several processes at once
is not supported (as with torch.distributed, every member must see them in the same
order).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.experimental import internal_kv

from . import _io, _object, _tree
from ._errors import CollectiveGroupError, ObjectFreedError, PeerDiedError, RDTError, translate
from ._membership import groups
from ._object import RDTObject
from ._store import store
from .transports import inline

KV_NAMESPACE = "rdt_async"
BACKENDS = ("gloo", "nccl")
PING_TIMEOUT_S = 60.0  # actors still starting answer late; dead ones fail at once


@dataclass(frozen=True)
class CollectiveGroup:
    """A collective group: its name, backend and member actors (rank = position)."""

    name: str
    backend: str
    actors: tuple[Any, ...]

    def __repr__(self) -> str:
        return f"CollectiveGroup({self.name!r}, backend={self.backend!r}, {len(self.actors)} members)"


def create_collective_group(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Make a collective group of `rdt.remote` actors; rank i is `actors[i]`.

    Callable from the driver or any actor (blocking; use `create_collective_group_async`
    on an event loop). `timeout_s` bounds the group's operations.
    Raises: CollectiveGroupError (a dead member, a name in use, a bad backend).
    """
    _no_loop("create_collective_group")
    return _io.submit(create_collective_group_async(actors, backend=backend, name=name, timeout_s=timeout_s)).result()


async def create_collective_group_async(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Async twin of `create_collective_group`; never blocks the loop."""
    actors = tuple(actors)
    _validate(actors, backend)
    name = name or f"{backend}-{secrets.token_hex(6)}"
    record = {"backend": backend, "actors": [a._actor_id.hex() for a in actors]}
    if await _io.to_thread(_claim, name, record):
        raise CollectiveGroupError(f"a collective group named {name!r} exists; destroy it or pick another name")
    try:
        await _ping_all(actors, name)
        host, port = await _await(actors[0].rdt__group.remote("host", name))
        await asyncio.gather(
            *(
                _await(a.rdt__group.remote("join", name, backend, rank, len(actors), host, port, timeout_s))
                for rank, a in enumerate(actors)
            )
        )
    except BaseException as exc:
        await _leave_all(actors, name)
        await _io.to_thread(_release, name)
        if isinstance(exc, CollectiveGroupError):
            raise
        raise CollectiveGroupError(f"creating collective group {name!r} failed: {_cause(exc)}") from exc
    return CollectiveGroup(name, backend, actors)


def destroy_collective_group(group: CollectiveGroup | str, /) -> None:
    """Tear a group down on every live member and free its name (dead members are skipped)."""
    _no_loop("destroy_collective_group")
    _io.submit(destroy_collective_group_async(group)).result()


async def destroy_collective_group_async(group: CollectiveGroup | str, /) -> None:
    """Async twin of `destroy_collective_group`."""
    if isinstance(group, str):
        raise TypeError("pass the CollectiveGroup that create_collective_group returned")
    await _leave_all(group.actors, group.name)
    await _io.to_thread(_release, group.name)


def serve(op: str, *args: Any) -> Any:
    """Run a group operation in a member (its `rdt` group calls this). Runs on: member."""
    from .transports import gloo

    if op == "ping":
        return True
    if op == "host":
        host = ray.util.get_node_ip_address()
        return host, gloo.host_store(args[0], host)
    if op == "join":
        gloo.join(*args)
        return True
    if op == "leave":
        _buffers.pop(args[0], None)
        return gloo.leave(args[0])
    if op == "collective":
        return _serve_part(args[0])
    if op == "break":
        return _break_here(*args)
    raise ValueError(f"unknown group operation {op!r}")


def _validate(actors: tuple[Any, ...], backend: str) -> None:
    if backend not in BACKENDS:
        raise CollectiveGroupError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if len(actors) < 2:
        raise CollectiveGroupError(f"a collective group needs at least 2 actors, got {len(actors)}")
    ids = []
    for i, a in enumerate(actors):
        if not isinstance(a, ray.actor.ActorHandle):
            raise CollectiveGroupError(f"member {i} is a {type(a).__name__}, not an actor handle")
        try:
            a.rdt__group
        except AttributeError:
            raise CollectiveGroupError(
                f"member {i} is not an rdt.remote actor: decorate its class with @rdt.remote"
            ) from None
        ids.append(a._actor_id)
    if len(set(ids)) != len(ids):
        raise CollectiveGroupError("an actor appears twice in the group")


async def _ping_all(actors: tuple[Any, ...], name: str) -> None:
    async def ping(i: int, a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await _await(a.rdt__group.remote("ping"))
        except BaseException as exc:
            raise CollectiveGroupError(
                f"cannot create group {name!r}: member {i} ({a._actor_id.hex()[:8]}) is dead or "
                f"unreachable ({_cause(exc)})"
            ) from exc

    await asyncio.gather(*(ping(i, a) for i, a in enumerate(actors)))


async def _leave_all(actors: Sequence[Any], name: str) -> None:
    async def leave(a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await _await(a.rdt__group.remote("leave", name))
        except BaseException:
            pass  # dead or unreachable: nothing left to tear down there

    await asyncio.gather(*(leave(a) for a in actors))


async def _await(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


def _claim(name: str, record: dict[str, Any]) -> bool:
    """Claim `name` in the GCS with the group's record; True if it was taken already."""
    blob = json.dumps(record).encode()
    return bool(internal_kv._internal_kv_put(f"group/{name}", blob, overwrite=False, namespace=KV_NAMESPACE))


def _record(name: str) -> dict[str, Any] | None:
    """Return the record of group `name` ({"backend", "actors": actor ids by rank}), or None."""
    blob = internal_kv._internal_kv_get(f"group/{name}", namespace=KV_NAMESPACE)
    try:
        return json.loads(blob) if blob is not None else None
    except ValueError:
        return None


def _release(name: str) -> None:
    internal_kv._internal_kv_del(f"group/{name}", namespace=KV_NAMESPACE)


def _no_loop(verb: str) -> None:
    if _io.running_loop() is not None:
        raise RuntimeError(f"rdt.{verb}() would block this thread's event loop; await rdt.{verb}_async() here")


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"


# Declarative collectives over RDT objects ---------------------------------------------

REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
_TORCH_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}
BREAK_GRACE_S = 10.0  # after breaking a group, how long the caller waits for the survivors' answers
BUFFERS_PER_SHAPE = 2  # result buffers a member keeps per (dtype, size) for reuse
COLLECT_BYTES = 1 << 20  # from this size, a busy buffer is worth a young-generation GC to free


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
    `group`. Every value has the same tensor shapes and dtypes (non-tensor leaves may
    differ; each result keeps its holder's). `op` is one of sum, prod, min, max, avg
    (avg needs floating-point tensors). All tensors of one dtype go in one collective.
    The inputs stay untouched unless `inplace=True`, which reduces into them. The new
    objects use `tensor_transport`, by default their holder's input's.

    Blocking (driver, sync actors); use `allreduce_async` on an event loop.
    Raises: CollectiveGroupError (holders not covering one group, one holder twice, a
    broken group), ValueError (mismatched shapes or dtypes, a bad op), PeerDiedError (a
    member died: the group is broken), ObjectFreedError.
    """
    _no_loop("allreduce")
    return _io.submit(
        allreduce_async(refs, op=op, group=group, inplace=inplace, tensor_transport=tensor_transport)
    ).result()


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
    _check_op(op)
    return await _io.run_io(_over_refs("allreduce", refs, group, op, inplace, tensor_transport))


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
    _no_loop("reduce_scatter")
    return _io.submit(reduce_scatter_async(refs, op=op, group=group, tensor_transport=tensor_transport)).result()


async def reduce_scatter_async(
    refs: Sequence[Any],
    /,
    *,
    op: str = "sum",
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `reduce_scatter`; never blocks the loop."""
    _check_op(op)
    return await _io.run_io(_over_refs("reduce_scatter", refs, group, op, False, tensor_transport))


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
    _no_loop("allgather")
    return _io.submit(allgather_async(refs, group=group, tensor_transport=tensor_transport)).result()


async def allgather_async(
    refs: Sequence[Any],
    /,
    *,
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `allgather`; never blocks the loop."""
    return await _io.run_io(_over_refs("allgather", refs, group, "sum", False, tensor_transport))


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
    _no_loop("broadcast")
    return _io.submit(broadcast_async(ref, to=to, group=group, tensor_transport=tensor_transport)).result()


async def broadcast_async(
    ref: Any,
    /,
    *,
    to: Sequence[Any],
    group: CollectiveGroup | str | None = None,
    tensor_transport: str | None = None,
) -> list[Any]:
    """Async twin of `broadcast`; never blocks the loop."""
    return await _io.run_io(_broadcast_call(ref, tuple(to), group, tensor_transport))


@dataclass(frozen=True)
class _Part:
    """One member's share of a collective, as the caller sends it."""

    kind: str  # allreduce | reduce_scatter | allgather | broadcast
    group: str
    rank: int  # the member's rank, as the group's record says
    size: int
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) of each tensor of a value
    obj_id: str | None  # the member's input; None for broadcast receivers
    skeletons: tuple[Any, ...]  # allgather: every value's, in refs order; else the result's
    order: tuple[int, ...] = ()  # rank of the holder of refs[i] (allgather, reduce_scatter)
    op: str = "sum"
    root: int = 0  # broadcast: the source's rank
    inplace: bool = False
    keep: bool = True  # produce a result here (broadcast bystanders do not)
    transport: str = "auto"
    inline: tuple[bytes, ...] | None = None  # the input's bytes, where its ref carries them


@dataclass(frozen=True)
class _Holder:
    actor: Any
    id: str  # actor id, hex

    @property
    def label(self) -> str:
        return f"actor {self.id[:8]}"


async def _over_refs(
    kind: str, refs: Sequence[Any], group: Any, op: str, inplace: bool, transport: str | None
) -> list[Any]:
    """Check, then run an allreduce, reduce_scatter or allgather. Runs on: caller (I/O loop)."""
    objs = await _resolve_all(kind, refs)
    holders = [_holder_of(kind, i, o) for i, o in enumerate(objs)]
    _check_distinct(kind, holders, "refs", "held by")
    name, record = await _pick_group(kind, objs, holders, group)
    ranks = _ranks(kind, name, record, holders)
    missing = [r for r, a in enumerate(record["actors"]) if r not in ranks]
    if missing:
        who = ", ".join(f"rank {r} (actor {record['actors'][r][:8]})" for r in missing)
        raise CollectiveGroupError(
            f"rdt.{kind} needs one ref from every member of group {name!r}; {who} holds none of them"
        )
    _check_values(kind, objs, holders, record["backend"])
    if op == "avg":
        _check_avg(kind, objs[0])
    if kind == "reduce_scatter":
        _check_divisible(objs[0], len(objs))
    specs = tuple((s.shape, s.dtype) for s in objs[0].specs)
    order = tuple(ranks)
    calls = []
    for o, h, r in zip(objs, holders, ranks):
        skeletons = tuple(x.skeleton for x in objs) if kind == "allgather" else (o.skeleton,)
        part = _Part(kind, name, r, len(ranks), specs, o.obj_id, skeletons, order, op,
                     inplace=inplace, transport=transport or o.transport, inline=_inline(o))  # fmt: skip
        calls.append((h, part))
    return await _launch(kind, name, calls)


async def _broadcast_call(ref: Any, to: tuple[Any, ...], group: Any, transport: str | None) -> list[Any]:
    """Check, then run a broadcast. Runs on: caller (I/O loop)."""
    (obj,) = await _resolve_all("broadcast", [ref])
    src = _holder_of("broadcast", 0, obj)
    receivers = [_member_handle("broadcast", i, a) for i, a in enumerate(to)]
    if not receivers:
        raise ValueError("rdt.broadcast needs at least one actor in to=")
    _check_distinct("broadcast", receivers, "to", "")
    everyone = {h.id: h for h in [src, *receivers]}
    if isinstance(group, CollectiveGroup):
        everyone.update((a._actor_id.hex(), _Holder(a, a._actor_id.hex())) for a in group.actors)
    name, record = await _pick_group("broadcast", [obj], list(everyone.values()), group)
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
    _check_values("broadcast", [obj], [src], record["backend"])
    specs = tuple((s.shape, s.dtype) for s in obj.specs)
    root = members.index(src.id)
    keep = {h.id for h in receivers}
    calls = []
    for rank, aid in enumerate(members):
        part = _Part("broadcast", name, rank, len(members), specs, obj.obj_id if aid == src.id else None,
                     (obj.skeleton,), root=root, keep=aid in keep, transport=transport or obj.transport,
                     inline=_inline(obj) if aid == src.id else None)  # fmt: skip
        calls.append((everyone[aid], part))
    refs = await _launch("broadcast", name, calls)
    by_id = {h.id: r for (h, _), r in zip(calls, refs)}
    return [by_id[h.id] for h in receivers]


async def _resolve_all(kind: str, refs: Sequence[Any]) -> list[RDTObject]:
    if isinstance(refs, (RDTObject, ray.ObjectRef)):
        raise TypeError(f"rdt.{kind} takes a list of refs, one per member")

    refs = list(refs)
    # Refs whose values are here already resolve in one call (cheaper than a future each).
    ready = await _io.to_thread(_get_ready, list(dict.fromkeys(x for x in refs if _object.is_ref(x))))

    async def one(i: int, x: Any) -> RDTObject:
        if _object.is_ref(x):
            try:
                x = ready[x] if x in ready else await _await(x)
            except BaseException as exc:
                err = translate(exc, f"rdt.{kind}: resolving ref {i}")
                if err is exc:
                    raise
                raise err from exc
        if not isinstance(x, RDTObject):
            raise TypeError(
                f"rdt.{kind}: ref {i} is a {type(x).__name__}, not an RDT object; produce the values "
                "with an @rdt.method of each member"
            )
        return x

    return list(await asyncio.gather(*(one(i, x) for i, x in enumerate(refs))))


def _get_ready(refs: list[Any]) -> dict[Any, Any]:
    """Return ref -> value for the refs whose values are ready (never waits for the others)."""
    if not refs:
        return {}
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    try:
        return dict(zip(ready, ray.get(ready, timeout=0))) if ready else {}
    except Exception:
        return {}  # an error value, or not local after all: the futures report it


def _holder_of(kind: str, i: int, obj: RDTObject) -> _Holder:
    actor = obj.producer.actor
    if actor is None:
        raise CollectiveGroupError(
            f"rdt.{kind}: ref {i} is held by {obj.producer.label}, which is in no collective group; "
            "produce it in a group member (an @rdt.method of an rdt.remote actor)"
        )
    if not obj.specs:
        raise ValueError(f"rdt.{kind}: ref {i} (held by {obj.producer.label}) holds no tensors")
    if store.was_freed(obj.obj_id):
        raise ObjectFreedError(f"rdt.{kind}: ref {i} (object {obj.obj_id}) was freed", obj_id=obj.obj_id)
    return _Holder(actor, actor._actor_id.hex())


def _member_handle(kind: str, i: int, actor: Any) -> _Holder:
    if not isinstance(actor, ray.actor.ActorHandle) or not hasattr(actor, "rdt__group"):
        raise CollectiveGroupError(f"rdt.{kind}: to[{i}] is not an rdt.remote actor handle")
    return _Holder(actor, actor._actor_id.hex())


def _check_distinct(kind: str, holders: Sequence[_Holder], what: str, verb: str) -> None:
    seen: dict[str, int] = {}
    for i, h in enumerate(holders):
        if h.id in seen:
            how = f"are both {verb} {h.label}" if verb else f"are both {h.label}"
            raise CollectiveGroupError(
                f"rdt.{kind}: {what}[{seen[h.id]}] and {what}[{i}] {how}; every member takes part once"
            )
        seen[h.id] = i


async def _pick_group(
    kind: str, objs: Sequence[RDTObject], holders: Sequence[_Holder], group: Any
) -> tuple[str, dict[str, Any]]:
    """Return the name and record of the group the collective runs on."""
    if group is not None:
        if not isinstance(group, (CollectiveGroup, str)):
            raise TypeError(f"group= takes a CollectiveGroup or a group name, not {type(group).__name__}")
        name = group.name if isinstance(group, CollectiveGroup) else group
        record = await _io.to_thread(_record, name)
        if record is None:
            raise CollectiveGroupError(f"rdt.{kind}: there is no collective group named {name!r} (destroyed?)")
        for i, h in enumerate(holders):
            if h.id not in record["actors"]:
                who = f"ref {i} is held by {h.label}, which" if i < len(objs) else f"{h.label} (in to=)"
                raise CollectiveGroupError(f"rdt.{kind}: {who} is not in collective group {name!r}")
        return name, record
    # Found from the refs: the groups every holder was in when it produced its value.
    mine = [set(o.meta.get("groups", {})) for o in objs]
    common = set.intersection(*mine)
    if not common:
        i = next((i for i, g in enumerate(mine) if not g & mine[0]), 0)
        raise CollectiveGroupError(
            f"rdt.{kind}: ref {i} is held by {holders[i].label}, which shares no collective group with the "
            f"holder of ref 0 ({holders[0].label}); put the holders in one group "
            "(rdt.create_collective_group), or pass group= if they joined it after producing the values"
        )
    ids = {h.id for h in holders}
    records = {n: await _io.to_thread(_record, n) for n in sorted(common)}
    live = {n: r for n, r in records.items() if r is not None}
    if kind == "broadcast":
        fits = [n for n, r in live.items() if set(r["actors"]) >= ids]
        exact = [n for n in fits if set(live[n]["actors"]) == ids]
        fits = exact or fits
    else:
        fits = [n for n, r in live.items() if set(r["actors"]) == ids]
    if len(fits) == 1:
        return fits[0], live[fits[0]]
    if len(fits) > 1:
        raise CollectiveGroupError(
            f"rdt.{kind}: the holders are all in groups {', '.join(map(repr, fits))}; pick one with group="
        )
    if kind == "broadcast" or not live:
        raise CollectiveGroupError(
            f"rdt.{kind}: no live collective group holds all of "
            f"{', '.join(h.label for h in holders)} (groups seen: {', '.join(map(repr, sorted(common)))})"
        )
    name, record = min(live.items())
    missing = [f"rank {r} (actor {a[:8]})" for r, a in enumerate(record["actors"]) if a not in ids]
    raise CollectiveGroupError(
        f"rdt.{kind} needs one ref from every member of group {name!r}; {', '.join(missing)} holds none of them"
    )


def _ranks(kind: str, name: str, record: dict[str, Any], holders: Sequence[_Holder]) -> list[int]:
    return [record["actors"].index(h.id) for h in holders]


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}")


def _check_values(kind: str, objs: Sequence[RDTObject], holders: Sequence[_Holder], backend: str) -> None:
    """Same tensor shapes and dtypes in every value, on the backend's device. Runs on: caller."""
    device = "cpu" if backend == "gloo" else "cuda"
    first = objs[0].specs
    for i, (o, h) in enumerate(zip(objs, holders)):
        if len(o.specs) != len(first):
            raise ValueError(
                f"rdt.{kind}: ref {i} (held by {h.label}) has {len(o.specs)} tensor(s), ref 0 has "
                f"{len(first)}; every holder needs values of the same structure"
            )
        for j, (a, b) in enumerate(zip(first, o.specs)):
            if b.device.split(":")[0] != device:
                raise ValueError(
                    f"rdt.{kind}: tensor {j} of ref {i} (held by {h.label}) is {b}; a {backend} group "
                    f"reduces {device} tensors"
                )
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise ValueError(
                    f"rdt.{kind}: tensor {j} of ref {i} (held by {h.label}) is {b} but ref 0's is {a}; "
                    "every holder needs the same shapes and dtypes"
                )


def _check_avg(kind: str, obj: RDTObject) -> None:
    for j, s in enumerate(obj.specs):
        if not (s.dtype.is_floating_point or s.dtype.is_complex):
            raise ValueError(
                f"rdt.{kind}(op='avg'): tensor {j} is {s}, and an average of integers would have to round; "
                "use op='sum' and divide (`t // n` or `t / n`), or make the tensors floating-point"
            )


def _check_divisible(obj: RDTObject, n: int) -> None:
    for j, s in enumerate(obj.specs):
        if not s.shape or s.shape[0] % n:
            raise ValueError(
                f"rdt.reduce_scatter: tensor {j} is {s}; its dim 0 must split evenly into {n} chunks"
            )


_locks: dict[str, asyncio.Lock] = {}  # per group, on the I/O loop: one collective at a time


async def _launch(kind: str, name: str, calls: list[tuple[_Holder, _Part]]) -> list[Any]:
    """Start every member's part and wait for all; return the calls' ObjectRefs.

    The work runs in a task that holds the group's lock until every member answered,
    so that cancelling the caller never lets the next collective overtake this one.
    """
    task = asyncio.ensure_future(_run_locked(kind, name, calls))
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


async def _run_locked(kind: str, name: str, calls: list[tuple[_Holder, _Part]]) -> list[Any]:
    lock = _locks.setdefault(name, asyncio.Lock())
    async with lock:
        refs = [h.actor.rdt__group.remote("collective", part) for h, part in calls]
        waits = [asyncio.ensure_future(_await(r)) for r in refs]
        for w in waits:
            w.add_done_callback(_retrieve)
        await _settle(kind, name, calls, waits)
        return refs


async def _settle(kind: str, name: str, calls: list[tuple[_Holder, _Part]], waits: list[Any]) -> None:
    """Wait for every member; on a failure other than a freed input, break the group."""
    pending, broken = set(waits), False
    while pending:
        done, pending = await asyncio.wait(
            pending, timeout=BREAK_GRACE_S if broken else None, return_when=asyncio.FIRST_EXCEPTION
        )
        if not done:
            break  # survivors did not answer in time after the break: they are failing anyway
        if not broken and any(_breaks(w.exception()) for w in done if w.exception()):
            broken = True
            dead = {i for i, w in enumerate(waits) if w.done() and _died(w.exception())}
            why = f"rdt.{kind} failed" + (f": rank {min(dead)} died" if dead else "")
            await _break_all([h for i, (h, _) in enumerate(calls) if i not in dead], name, why)
    failed = [(i, w.exception()) for i, w in enumerate(waits) if w.done() and w.exception()]
    if not failed:
        return
    i, exc = min(failed, key=lambda f: _severity(f[1]))
    holder, part = calls[i]
    what = f"rdt.{kind} on group {name!r}"
    if _died(exc):
        raise PeerDiedError(
            f"{what}: rank {part.rank} ({holder.label}) died during the collective; the group is broken "
            "in every survivor: destroy it and create a new one"
        ) from exc
    err = translate(exc, f"{what}, rank {part.rank} ({holder.label})", part.obj_id)
    raise err from exc


def _severity(exc: BaseException | None) -> int:
    cause = getattr(exc, "cause", None)
    if _died(exc):
        return 0
    if isinstance(cause, CollectiveGroupError):
        return 1
    if isinstance(cause, ObjectFreedError):
        return 3
    return 2


def _died(exc: BaseException | None) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError)


def _breaks(exc: BaseException | None) -> bool:
    """Say whether a member's failure leaves others stuck in the collective (so: break it)."""
    return exc is not None and not isinstance(getattr(exc, "cause", None), ObjectFreedError)


async def _break_all(holders: Sequence[_Holder], name: str, why: str) -> None:
    async def one(h: _Holder) -> None:
        try:
            async with asyncio.timeout(BREAK_GRACE_S):
                await _await(h.actor.rdt__group.remote("break", name, why))
        except (Exception, TimeoutError):
            pass  # dead too, or unreachable: nothing to mark there

    await asyncio.gather(*(one(h) for h in holders))


def _retrieve(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # mark it retrieved: the caller may have stopped waiting


# The member's side.


def _break_here(name: str, why: str) -> bool:
    """Mark group `name` broken here and abort its process group, so no one waits on it.

    Runs on: member.
    """
    return groups.abort(name, why)


def _serve_part(part: _Part) -> RDTObject | None:
    """Run this member's part of a collective; return the RDTObject it produced here.

    Runs on: member (a thread of its `rdt` group or of the I/O pool; never a loop).
    Raises: CollectiveGroupError before any communication if this process is not the
    rank the caller expects; ObjectFreedError after taking part with zeros if the input
    was freed (so that the others do not wait); PeerDiedError or BackendError if the
    collective fails, which also marks the group broken here.
    """
    group = groups.require(part.group)
    if (group.rank, group.size) != (part.rank, part.size):
        raise CollectiveGroupError(
            f"rdt.{part.kind}: this member is rank {group.rank} of {group.size} in group {part.group!r}, "
            f"not rank {part.rank} of {part.size} (was the group recreated?)"
        )
    device = torch.device("cuda" if group.backend == "nccl" else "cpu")
    buffers = _buffers_of(part.group)
    try:
        with _reading_inputs(part, device) as (inputs, freed):  # held: wait_tensor_freed waits
            value = _KINDS[part.kind](group, part, inputs, buffers, device)
    except BaseException as exc:
        groups.mark_broken(part.group, f"rdt.{part.kind} failed in rank {group.rank}: {type(exc).__name__}")
        raise _collective_error(exc, part) from exc
    if freed:
        raise ObjectFreedError(
            f"rdt.{part.kind}: the input of rank {part.rank} (object {part.obj_id}) was freed before the "
            "collective; it took part with zeros",
            obj_id=part.obj_id,
        )
    if not part.keep:
        return None
    return _object.produce(value, part.transport, owner=_object.here())


@contextlib.contextmanager
def _reading_inputs(part: _Part, device: torch.device) -> Iterator[tuple[list[torch.Tensor] | None, bool]]:
    """Yield this member's inputs (zeros if they were freed) and whether they were freed."""
    if part.obj_id is None:
        yield None, False
        return
    if part.inline is not None:  # nothing kept here: the ref's bytes are the input
        yield [t.to(device) for t in inline.decode(part.inline, part.specs)], False
        return
    with store.reading(part.obj_id) as stored:
        if stored is None:
            yield [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in part.specs], True
        else:
            yield stored.tensors, False


def _inline(obj: RDTObject) -> tuple[bytes, ...] | None:
    """The bytes of an object its producer keeps nothing for (see transports/inline.py)."""
    return obj.meta.get("inline") if obj.anchor is None else None


def _collective_error(exc: BaseException, part: _Part) -> BaseException:
    if isinstance(exc, RDTError):
        return exc
    text = str(exc)
    if any(s in text for s in ("Connection closed", "Connection reset", "Read error", "Broken pipe", "abort")):
        return PeerDiedError(
            f"rdt.{part.kind} on group {part.group!r}: a peer went away during the collective "
            f"(it died, or the group was broken): {type(exc).__name__}: {text[:200]}"
        )
    return translate(exc, f"rdt.{part.kind} on group {part.group!r}", part.obj_id)


class _Buffers:
    """Buffers of one group's collectives in this member, reused once nothing else holds them.

    A buffer is handed out as an alias (a view), so that it counts as held while that
    alias, or any view of it (the tensors of a result object), is alive. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[torch.dtype, int, str], list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        key = (dtype, numel, str(device))
        with self._lock:
            kept = self._kept.setdefault(key, [])
            for attempt in range(2):
                for b in kept:
                    if _unshared(b):
                        return b.view(-1)
                if not kept or attempt or numel * dtype.itemsize < COLLECT_BYTES:
                    break
                # Flattening a value makes short-lived reference cycles (recursive closures)
                # that hold its tensors until the cyclic GC runs: collect the young ones
                # (well under a millisecond) rather than fault in fresh memory.
                gc.collect(1)
            b = torch.empty(numel, dtype=dtype, device=device)
            if len(kept) < BUFFERS_PER_SHAPE:
                kept.append(b)
            return b.view(-1)


def _unshared(t: torch.Tensor) -> bool:
    """Say whether nothing but `t` itself holds its storage (False where torch cannot tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(t.untyped_storage()._cdata) <= 2)  # t, and the storage object asked


_buffers: dict[str, _Buffers] = {}
_buffers_lock = threading.Lock()


def _buffers_of(name: str) -> _Buffers:
    with _buffers_lock:
        return _buffers.setdefault(name, _Buffers())


def _buckets(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[torch.dtype, list[int]]]:
    """Group tensor indices by dtype, in order of first appearance (the same in every member)."""
    by: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(specs):
        by.setdefault(dtype, []).append(i)
    return list(by.items())


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _views(buf: torch.Tensor, shapes: Sequence[Sequence[int]], start: int = 0) -> list[torch.Tensor]:
    out, off = [], start
    for shape in shapes:
        n = _numel(shape)
        out.append(buf.narrow(0, off, n).view(tuple(shape)))
        off += n
    return out


def _pack(buf: torch.Tensor, tensors: Sequence[torch.Tensor], start: int = 0) -> None:
    for v, t in zip(_views(buf, [tuple(t.shape) for t in tensors], start), tensors):
        v.copy_(t)


def _flat(tensors: list[torch.Tensor] | None, idx: list[int]) -> torch.Tensor | None:
    """The one tensor of a bucket as a flat view, if it can go to the backend as it is."""
    if tensors is None or len(idx) != 1 or not tensors[idx[0]].is_contiguous():
        return None
    return tensors[idx[0]].view(-1)


def _wait(group: Any, works: list[Any]) -> None:
    """Wait for the works in this thread (never a loop's: members run parts in threads)."""
    for w in works:
        w.wait()
    if group.backend == "nccl":
        torch.cuda.current_stream().synchronize()


def _reduce_op(op: str) -> Any:
    return getattr(torch.distributed.ReduceOp, _TORCH_OPS[op])


def _run_allreduce(group: Any, part: _Part, inputs: Any, buffers: _Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.AllreduceOptions()
    opts.reduceOp = _reduce_op(part.op)
    shapes = [s for s, _ in part.specs]
    out: list[torch.Tensor] = list(inputs)
    works, copy_back = [], []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        if n == 0:
            if not part.inplace:
                for i in idx:
                    out[i] = torch.empty(shapes[i], dtype=dtype, device=device)
            continue
        buf = _flat(inputs, idx) if part.inplace else None
        if buf is None:
            buf = buffers.take(dtype, n, device)  # the result, or scratch for a packed inplace
            _pack(buf, [inputs[i] for i in idx])
            views = _views(buf, [shapes[i] for i in idx])
            if part.inplace:
                copy_back.append((idx, views))
            else:
                for i, v in zip(idx, views):
                    out[i] = v
        works.append(group.pg.allreduce([buf], opts))
    _wait(group, works)
    for idx, views in copy_back:
        for i, v in zip(idx, views):
            inputs[i].copy_(v)
    return _tree.unflatten(part.skeletons[0], out)


def _run_broadcast(group: Any, part: _Part, inputs: Any, buffers: _Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = part.root, 0
    shapes = [s for s, _ in part.specs]
    source = group.rank == part.root
    out: list[torch.Tensor] = [None] * len(shapes)  # type: ignore[list-item]
    works = []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        buf = _flat(inputs, idx) if source and not part.keep else None  # send the input as it is
        if buf is None:
            buf = buffers.take(dtype, n, device)
            if source:
                _pack(buf, [inputs[i] for i in idx])
        for i, v in zip(idx, _views(buf, [shapes[i] for i in idx])):
            out[i] = v
        if n:
            works.append(group.pg.broadcast([buf], opts))
    _wait(group, works)
    return _tree.unflatten(part.skeletons[0], out) if part.keep else None


def _run_allgather(group: Any, part: _Part, inputs: Any, buffers: _Buffers, device: torch.device) -> Any:
    shapes = [s for s, _ in part.specs]
    size = part.size
    per_rank: list[list[torch.Tensor]] = [[None] * len(shapes) for _ in range(size)]  # type: ignore[list-item]
    works, held = [], []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        inp = _flat(inputs, idx)
        if inp is None:
            inp = buffers.take(dtype, n, device)
            _pack(inp, [inputs[i] for i in idx])
        out = buffers.take(dtype, n * size, device)
        for r in range(size):
            for i, v in zip(idx, _views(out, [shapes[i] for i in idx], r * n)):
                per_rank[r][i] = v
        held.append(inp)
        if n:
            works.append(group.pg._allgather_base(out, inp))
    _wait(group, works)
    return [_tree.unflatten(part.skeletons[p], per_rank[r]) for p, r in enumerate(part.order)]


def _run_reduce_scatter(group: Any, part: _Part, inputs: Any, buffers: _Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(part.op)
    size = part.size
    chunk_shapes = [(s[0] // size, *s[1:]) for s, _ in part.specs]
    out: list[torch.Tensor] = [None] * len(chunk_shapes)  # type: ignore[list-item]
    works, held = [], []
    for dtype, idx in _buckets(part.specs):
        per = sum(_numel(chunk_shapes[i]) for i in idx)
        inp = _flat(inputs, idx) if part.order == tuple(range(size)) else None
        if inp is None:
            # Rank r receives block r: put chunk p of every tensor where its holder's rank is.
            inp = buffers.take(dtype, per * size, device)
            for p, r in enumerate(part.order):
                _pack(inp, [inputs[i].chunk(size, 0)[p] for i in idx], r * per)
        res = buffers.take(dtype, per, device)
        for i, v in zip(idx, _views(res, [chunk_shapes[i] for i in idx])):
            out[i] = v
        held.append(inp)
        if per:
            works.append(group.pg._reduce_scatter_base(res, inp, opts))
    _wait(group, works)
    return _tree.unflatten(part.skeletons[0], out)


_KINDS = {
    "allreduce": _run_allreduce,
    "broadcast": _run_broadcast,
    "allgather": _run_allgather,
    "reduce_scatter": _run_reduce_scatter,
}
