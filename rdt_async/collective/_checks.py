"""What a caller checks before a collective sends anything: the refs resolve to RDT
objects, their holders are distinct members of one group (found from the refs, or
named), and the values agree in tensor shapes, dtypes and device. From the objects'
metadata alone: no tensor moves. Runs on: the caller (its I/O loop).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from .. import _io, _tree
from .._errors import CollectiveGroupError, ObjectFreedError, few, translate
from .._object import RDTObject
from .._ray import await_ref
from .._store import store
from . import _records
from ._groups import CollectiveGroup

REDUCE_OPS = ("sum", "prod", "min", "max", "avg")


@dataclass(frozen=True)
class Holder:
    """A member taking part in a collective: its handle and actor id (hex)."""

    actor: Any
    id: str

    @property
    def label(self) -> str:
        return f"actor {self.id[:8]}"


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}")


async def resolve_all(verb: str, refs: Sequence[Any]) -> list[RDTObject]:
    """Return the RDTObject of each ref (ObjectRef or RDTObject), in order."""
    if isinstance(refs, (RDTObject, ray.ObjectRef)):
        raise TypeError(f"rdt.{verb} takes a list of refs, one per member")

    refs = list(refs)
    if not refs:
        raise ValueError(f"rdt.{verb} needs one ref from each member; it got none")
    # Refs whose values are here already resolve in one call (cheaper than a future each).
    ready = await _io.to_thread(_get_ready, list(dict.fromkeys(x for x in refs if isinstance(x, ray.ObjectRef))), purpose=_io.CALLS)

    async def one(i: int, x: Any) -> RDTObject:
        if isinstance(x, ray.ObjectRef):
            try:
                x = ready[x] if x in ready else await await_ref(x)
            except BaseException as exc:
                err = translate(exc, f"rdt.{verb}: resolving ref {i}")
                if err is exc:
                    raise
                raise err from exc
        if not isinstance(x, RDTObject):
            raise TypeError(
                f"rdt.{verb}: ref {i} is a {type(x).__name__}, not an RDT object; produce the values "
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


async def holder_of(verb: str, i: int, obj: RDTObject) -> Holder:
    """Return the member holding `obj` (ref `i`), checking that it holds tensors still."""
    actor = await obj.producer.handle()
    if actor is None:
        raise CollectiveGroupError(
            f"rdt.{verb}: ref {i} is held by {obj.producer.label}, which is in no collective group; "
            "produce it in a group member (an @rdt.method of an rdt.remote actor)"
        )
    if not obj.specs:
        raise ValueError(f"rdt.{verb}: ref {i} (held by {obj.producer.label}) holds no tensors")
    if store.was_freed(obj.obj_id):
        raise ObjectFreedError(f"rdt.{verb}: ref {i} (object {obj.obj_id}) was freed", obj_id=obj.obj_id)
    return Holder(actor, actor._actor_id.hex())


def member_handle(verb: str, i: int, actor: Any) -> Holder:
    """Return `to[i]` as a Holder, checking that it is an rdt.remote actor."""
    if not isinstance(actor, ray.actor.ActorHandle) or not hasattr(actor, "rdt__group"):
        raise CollectiveGroupError(f"rdt.{verb}: to[{i}] is not an rdt.remote actor handle")
    return Holder(actor, actor._actor_id.hex())


def check_distinct(verb: str, holders: Sequence[Holder], what: str, how: str) -> None:
    seen: dict[str, int] = {}
    for i, h in enumerate(holders):
        if h.id in seen:
            both = f"are both {how} {h.label}" if how else f"are both {h.label}"
            raise CollectiveGroupError(
                f"rdt.{verb}: {what}[{seen[h.id]}] and {what}[{i}] {both}; every member takes part once"
            )
        seen[h.id] = i


async def pick_group(
    verb: str, objs: Sequence[RDTObject], holders: Sequence[Holder], group: Any
) -> tuple[str, dict[str, Any]]:
    """Return the name and record of the group the collective runs on."""
    if group is not None:
        if not isinstance(group, (CollectiveGroup, str)):
            raise TypeError(f"group= takes a CollectiveGroup or a group name, not {type(group).__name__}")
        name = group.name if isinstance(group, CollectiveGroup) else group
        record = await _io.to_thread(_records.record, name, purpose=_io.CALLS)
        if record is None:
            raise CollectiveGroupError(f"rdt.{verb}: there is no collective group named {name!r} (destroyed?)")
        if isinstance(group, CollectiveGroup) and group.creation not in (None, record["creation"]):
            raise CollectiveGroupError(
                f"rdt.{verb}: collective group {name!r} was destroyed and made anew since this CollectiveGroup "
                "was made; pass the new group's (or its name)"
            )
        for i, h in enumerate(holders):
            if h.id not in record["actors"]:
                who = f"ref {i} is held by {h.label}, which" if i < len(objs) else f"{h.label} (in to=)"
                raise CollectiveGroupError(f"rdt.{verb}: {who} is not in collective group {name!r}")
        return name, record
    # Found from the refs: the groups every holder was in when it produced its value.
    mine = [set(o.meta.get("groups", {})) for o in objs]
    common = set.intersection(*mine)
    if not common:
        i = next((i for i, g in enumerate(mine) if not g & mine[0]), 0)
        raise CollectiveGroupError(
            f"rdt.{verb}: ref {i} is held by {holders[i].label}, which shares no collective group with the "
            f"holder of ref 0 ({holders[0].label}); put the holders in one group "
            "(rdt.create_collective_group), or pass group= if they joined it after producing the values"
        )
    ids = {h.id for h in holders}
    records = {n: await _io.to_thread(_records.record, n, purpose=_io.CALLS) for n in sorted(common)}
    live = {n: r for n, r in records.items() if r is not None}
    if verb == "broadcast":
        fits = [n for n, r in live.items() if set(r["actors"]) >= ids]
        exact = [n for n in fits if set(live[n]["actors"]) == ids]
        fits = exact or fits
    else:
        fits = [n for n, r in live.items() if set(r["actors"]) == ids]
    if len(fits) == 1:
        return fits[0], live[fits[0]]
    if len(fits) > 1:
        raise CollectiveGroupError(
            f"rdt.{verb}: the holders are all in groups {', '.join(map(repr, fits))}; pick one with group="
        )
    if verb == "broadcast" or not live:
        raise CollectiveGroupError(
            f"rdt.{verb}: no live collective group holds all of "
            f"{', '.join(h.label for h in holders)} (groups seen: {', '.join(map(repr, sorted(common)))})"
        )
    name, record = min(live.items())
    raise _uncovered(verb, name, record, ids)


def check_covered(verb: str, name: str, record: dict[str, Any], ids: set[str]) -> None:
    """Raise CollectiveGroupError if a member of group `name` holds none of the refs."""
    if not set(record["actors"]) <= ids:
        raise _uncovered(verb, name, record, ids)


def _uncovered(verb: str, name: str, record: dict[str, Any], ids: set[str]) -> CollectiveGroupError:
    missing = [f"rank {r} (actor {a[:8]})" for r, a in enumerate(record["actors"]) if a not in ids]
    return CollectiveGroupError(
        f"rdt.{verb} needs one ref from every member of group {name!r}; {', '.join(missing)} holds none of them"
    )


def check_values(verb: str, objs: Sequence[RDTObject], holders: Sequence[Holder], backend: str) -> None:
    """Same tensor shapes and dtypes in every value, on the backend's device."""
    device = "cpu" if backend == "gloo" else "cuda"
    first = objs[0].specs
    for i, (o, h) in enumerate(zip(objs, holders)):
        if len(o.specs) != len(first):
            raise ValueError(
                f"rdt.{verb}: ref {i} (held by {h.label}) has {len(o.specs)} tensor(s), ref 0 has "
                f"{len(first)}; every holder needs values of the same structure"
            )
        for j, (a, b) in enumerate(zip(first, o.specs)):
            if b.device.split(":")[0] != device:
                raise ValueError(
                    f"rdt.{verb}: tensor {j} of ref {i} (held by {h.label}) is {b}; a {backend} group "
                    f"reduces {device} tensors"
                )
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise ValueError(
                    f"rdt.{verb}: tensor {j} of ref {i} (held by {h.label}) is {b} but ref 0's is {a}; "
                    "every holder needs the same shapes and dtypes"
                )


def check_names(verb: str, objs: Sequence[RDTObject], holders: Sequence[Holder]) -> None:
    """The same names for the tensors of every value, in one order: a reduction pairs them
    by their place in the value (`{"w", "b"}` and `{"b", "w"}` of one shape summed each
    rank's w with another's b, silently)."""
    first = _tree.names(objs[0].skeleton)
    order = _tree.slot_order(objs[0].skeleton)
    for i, (o, h) in enumerate(zip(objs, holders)):
        names = _tree.names(o.skeleton)
        if names != first or _tree.slot_order(o.skeleton) != order:
            raise ValueError(
                f"rdt.{verb}: ref {i} (held by {h.label}) names its tensors {few(names or ['?'])}, ref 0 "
                f"{few(first or ['?'])}: tensors are reduced by their place in the value, so every holder's "
                "value must name the same tensors in one order (build the dicts in one order)"
            )


# What Gloo's reductions refuse (every dtype and op run on torch 2.13's Gloo): a member
# meeting them failed inside the collective, which broke the group for every member.
GLOO_NEVER = frozenset({
    torch.int16, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
})


# What NCCL reduces (torch's ProcessGroupNCCL: its table of NCCL's dtypes). Complex
# tensors: in allreduce alone, as pairs of reals, so by sum and avg. Float8: where torch's
# NCCL has float8 reductions (2.24 on), else torch refuses them. torch raised the others
# in every member, inside the collective, which broke the group.
NCCL_REDUCES = frozenset({
    torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})
NCCL_FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


@functools.cache
def _nccl_has_float8() -> bool:
    """Whether the NCCL torch loads here reduces float8 (2.24 on); False without NCCL."""
    try:
        return tuple(torch.cuda.nccl.version()) >= (2, 24)
    except Exception:  # (a build without CUDA or NCCL)
        return False


def check_reducible(verb: str, obj: RDTObject, backend: str, op: str) -> None:
    """Dtypes and ops the group's backend reduces (Gloo's, NCCL's)."""
    if backend == "nccl":
        _check_nccl_reduces(verb, obj, op)
        return
    for j, s in enumerate(obj.specs):
        if s.dtype in GLOO_NEVER:
            raise ValueError(
                f"rdt.{verb}: tensor {j} is {s}, and Gloo reduces no {str(s.dtype).removeprefix('torch.')} "
                "tensors; convert them (e.g. to int32 or float32) before returning them"
            )
        if s.dtype.is_complex and (op in ("max", "min", "prod") or (op == "avg" and s.dtype == torch.complex32)):
            raise ValueError(
                f"rdt.{verb}(op={op!r}): tensor {j} is {s}, and Gloo has no {op} of "
                f"{str(s.dtype).removeprefix('torch.')} tensors; use op='sum' (or 'avg' of complex64)"
            )


def _check_nccl_reduces(verb: str, obj: RDTObject, op: str) -> None:
    for j, s in enumerate(obj.specs):
        name = str(s.dtype).removeprefix("torch.")
        if s.dtype.is_complex:
            if verb != "allreduce" or op not in ("sum", "avg"):
                raise ValueError(
                    f"rdt.{verb}(op={op!r}): tensor {j} is {s}, and NCCL reduces {name} tensors only in "
                    "allreduce by 'sum' or 'avg'; use those, or return torch.view_as_real(t) to reduce its parts"
                )
        elif s.dtype in NCCL_FLOAT8 and not _nccl_has_float8():
            raise ValueError(
                f"rdt.{verb}: tensor {j} is {s}, and the NCCL torch loads here reduces no float8 tensors "
                "(NCCL 2.24 and later do); convert them (e.g. to bfloat16) before returning them"
            )
        elif s.dtype not in NCCL_REDUCES | NCCL_FLOAT8:
            raise ValueError(
                f"rdt.{verb}: tensor {j} is {s}, and NCCL reduces no {name} tensors; convert them "
                "(e.g. to int32, bfloat16 or float32) before returning them"
            )


def check_inplace(verb: str, objs: Sequence[RDTObject], holders: Sequence[Holder], backend: str) -> None:
    """`inplace=True` reduces into the tensors each producer keeps: an input returned over
    another transport than the group's may be read from a copy taken at return (inline,
    shm segments, the object store), which would keep the old value."""
    for i, (o, h) in enumerate(zip(objs, holders)):
        if o.transport != backend:
            raise ValueError(
                f"rdt.{verb}(inplace=True): ref {i} (held by {h.label}) was returned over "
                f"{o.transport!r}, whose fetches may read a copy taken at return: it would not hold the "
                f"result everywhere. Return the inputs with tensor_transport={backend!r}, or use the "
                "refs the collective returns (inplace=False)"
            )


def check_avg(verb: str, obj: RDTObject) -> None:
    for j, s in enumerate(obj.specs):
        if not (s.dtype.is_floating_point or s.dtype.is_complex):
            raise ValueError(
                f"rdt.{verb}(op='avg'): tensor {j} is {s}, and an average of integers would have to round; "
                "use op='sum' and divide (`t // n` or `t / n`), or make the tensors floating-point"
            )


def check_divisible(obj: RDTObject, n: int) -> None:
    for j, s in enumerate(obj.specs):
        if not s.shape or s.shape[0] % n:
            raise ValueError(
                f"rdt.reduce_scatter: tensor {j} is {s}; its dim 0 must split evenly into {n} chunks"
            )
