"""The fetch pipeline, top to bottom: check the ref and the `into=` buffers (`_object`,
`_buffers`), take what needs no waiting (this process's own object, a transport's
`receive_nowait`), else choose the transport (`_choose`) and transfer (`_transfer`: the
producer watched, `auto`'s fallbacks), through the node relay where it pays (`_relay`);
then land the tensors where the caller asked (`_buffers.land`) and count the fetch.

Runs on: consumer. The verbs in `_api.py` call `fetch_object` (a loop) and `fetch_now`
(a thread that may not block: what needs no waiting).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any

import torch

from . import _buffers, _cuda, _metrics, _object, _ray, _relay, _tree
from ._choose import transport_for
from ._errors import (
    CollectiveGroupError,
    ObjectFreedError,
    PeerDiedError,
    TransferError,
    release_frames,
    translating,
)
from ._fetched import fetched
from ._local import copy_into, in_buffers
from ._object import RDTObject
from ._store import log, store
from ._transfer import fetch_over, info_for, tensors_of
from .transports._base import TransferInfo, Transport


async def fetch_object(
    obj: RDTObject, *, device: Any, into: Any, start: _Start | None = None, tensor_transport: str | None = None
) -> Any:
    """Return `obj`'s value with its tensors here (`start`: what `fetch_now` left to do;
    `tensor_transport`: the one the consumer asked for, else the producer's choice).

    Records the fetch (store stats, Ray metrics) and what failed it.
    """
    began = time.perf_counter()
    name = obj.transport  # until one is chosen
    try:
        start = start or await _started(obj, into, device, tensor_transport)
        writes = start.writes  # the `into=` buffers' bytes, claimed until nothing writes them
        if writes is not None:
            await writes.claim()  # (at once, unless another fetch writes these buffers: until it ends)
        if isinstance(start, _Done):
            tensors, buffers, name = start.tensors, start.buffers, start.transport
        else:
            name = start.transport.name
            tensors, buffers, name = await _transferred(obj, start, device, tensor_transport)
        tensors = await _buffers.land(tensors, buffers, None if device is None else torch.device(device), writes, obj.nbytes)
    except BaseException as exc:
        _metrics.failed(name, exc)
        if isinstance(exc, PeerDiedError):
            _ray.lost(obj.producer)
        release_frames(exc)
        del exc  # (a cycle through this frame otherwise: see _api._all_or_none)
        raise
    finally:
        if start is not None:
            start.release()  # (its writes, and its hold on a same-process object's tensors)
    _record(obj, name, began)
    return _tree.unflatten(obj.skeleton, tensors)


async def _transferred(
    obj: RDTObject, plan: _Plan, device: Any, asked: str | None
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, str]:
    """Carry out `plan`: the tensors, the buffers still to copy them into (None where they
    landed there), and the path they took (`relay` where another fetch's read served them)."""
    transport, info, buffers, writes = plan.transport, plan.info, plan.buffers, plan.writes
    name = transport.name
    await _cuda.wait(plan.ready)  # the caller's queued work on the destinations has run
    if device is None and _relayed(obj, name, buffers):
        # The first consumer of the node lands the bytes in a memfd it hands over
        # (DIRECT: also with `into=` where a warm one is there, so that the others map it
        # as soon as the read ends), else in its `into=` buffers or where its transport puts
        # them; the others map the memfd, and those with `into=` copy from it.
        used = [name]  # the path the read took, where auto fell back (`fetch_over`)
        transfer = functools.partial(fetch_over, obj, transport, info, buffers, used, asked, writes=writes)
        direct = transport.fills_buffers
        into = functools.partial(fetch_over, obj, transport, info, used=used, asked=asked) if direct else None
        tensors, relayed = await _relay.fetch(
            _relay.name_of(obj.obj_id, obj.producer, name, obj.specs, info.meta), obj.specs, tensors_of(transfer), tensors_of(into),
            warm_only=buffers is not None, source=_relay.source_of(obj.producer.node_id, obj.producer.pid), buffers=buffers,
        )
        name = "relay" if relayed else used[0]
    else:
        tensors, name = await fetch_over(obj, transport, info, buffers, asked=asked, writes=writes)
    if buffers is not None and in_buffers(tensors, buffers):
        buffers = None  # written (a transport that handed back tensors of its own: copied by the caller)
    return tensors, buffers, name


def _relayed(obj: RDTObject, transport: str, buffers: list[torch.Tensor] | None) -> bool:
    """Whether this fetch goes through the node relay (into `buffers` in this process's memory, if any)."""
    if buffers is not None and not all(b.device.type == "cpu" for b in buffers):
        return False
    node = _ray.node_id()
    return node != _ray.NO_NODE and _relay.eligible(obj.specs, transport, obj.producer.node_id, node)  # (a client: no node)


def abandon(start: Any) -> None:
    """Let go of what `fetch_now` left (`start`) where `fetch_object` never ran it (a
    `rdt.get` timed out or interrupted before the fetch began): the claim on its `into=`
    buffers (another fetch into them waited for good) and its hold."""
    if start is not None:
        start.release()


async def _started(obj: RDTObject, into: Any, device: Any, asked: str | None) -> _Start:
    """`_start`, where a group both ends share is broken: the producer's death may be
    why, and then that is the error (asked of Ray; a producer on another node cannot be
    seen to die from here)."""
    try:
        return _start(obj, into, device, asked)
    except CollectiveGroupError as exc:
        await _ray.raise_if_died(obj, obj.transport, exc)
        raise


def fetch_now(obj: RDTObject, *, device: Any, into: Any, tensor_transport: str | None = None) -> tuple[bool, Any]:
    """Fetch on the caller's thread if nothing can block: (True, value), else (False, start)."""
    began = time.perf_counter()
    try:
        start = _start(obj, into, device, tensor_transport)
    except BaseException as exc:
        if isinstance(exc, CollectiveGroupError) and obj.producer.serves and not _ray.known_lost(obj.producer):
            del exc
            return False, None  # a broken group: Ray may know why (the producer died), `fetch_object` asks
        _metrics.failed(obj.transport, exc)
        del exc  # (a cycle through this frame otherwise: see _api._all_or_none)
        raise
    if not isinstance(start, _Done) or obj.nbytes > _buffers.INLINE_COPY_BYTES:
        return False, start  # the transfer (or a large copy) belongs to the I/O loop
    if start.writes is not None and not start.writes.claim_nowait():
        return False, start  # another fetch writes these buffers: wait for it on a loop
    try:
        tensors = _buffers.land_now(start.tensors, start.buffers, device, start.writes)
    finally:
        start.release()
    _record(obj, start.transport, began)
    return True, _tree.unflatten(obj.skeleton, tensors)


@dataclasses.dataclass
class _Done:
    """A fetch whose tensors were had at once: `buffers` are still to be filled. `hold`:
    the store's hold on a same-process object's tensors until they are copied (a free
    meanwhile makes `wait_tensor_freed` wait for the copy); let go by `release`, or
    once the start is dropped."""

    tensors: list[torch.Tensor]
    buffers: list[torch.Tensor] | None
    transport: str
    writes: _buffers.Writes | None = None
    hold: Any = None

    def release(self) -> None:
        """Let go of the buffers' claim and the hold (idempotent)."""
        if self.writes is not None:
            self.writes.release()
        if self.hold is not None:
            self.hold()


@dataclasses.dataclass
class _Plan:
    """A fetch to transfer: over `transport`, told `info`, into `buffers` (the caller's, or
    made on the device asked for; None: where the transport puts them) once the events on
    the caller's streams (`ready`) have run; `writes`: the bytes of the caller's buffers,
    claimed before they are written (`_buffers.Writes`)."""

    transport: Transport[Any]
    info: TransferInfo[Any]
    buffers: list[torch.Tensor] | None
    ready: list[Any]
    writes: _buffers.Writes | None

    def release(self) -> None:
        """Let go of the buffers' claim (idempotent)."""
        if self.writes is not None:
            self.writes.release()


_Start = _Done | _Plan  # what `_start` leaves: tensors had at once, or a transfer to make


def _start(obj: RDTObject, into: Any, device: Any = None, asked: str | None = None) -> _Start:
    """Check the fetch and do what needs no waiting; else return what to transfer with
    (over the transport the consumer `asked` for, if any)."""
    _object.check(obj)  # everything a ref carries came from another process
    if store.was_freed(obj.obj_id):
        raise ObjectFreedError(f"object {obj.obj_id} was freed", obj_id=obj.obj_id)
    buffers, writes = _buffers.checked_writes(obj.specs, into, obj.skeleton)  # before anything moves
    try:
        if device is not None:
            _check_device(torch.device(device))
        if not obj.specs:
            return _Done([], None, "none")
        if _object.is_local(obj):
            return _local(obj, buffers, writes, device)
        if buffers is not None:
            _buffers.check_unheld(*_buffers.every(buffers, writes))
        _ray.hand_node_ip()  # before a transport first connects (UCX keeps to this address's interface)
        transport, meta = transport_for(obj, _ray.node_id(), asked)
        plan = _Plan(transport, info_for(obj, meta), buffers, [], writes)
        if buffers is None and device is not None:
            plan.buffers = _device_buffers(transport, plan.info, torch.device(device))
        plan.ready = _cuda.record(plan.buffers or ())
        return _now(obj, plan) or plan
    except BaseException:
        if writes is not None:
            writes.release()
        raise


def _local(obj: RDTObject, buffers: list[torch.Tensor] | None, writes: _buffers.Writes | None, device: Any) -> _Done:
    """A fetch of an object this process produced: its tensors themselves (copied into
    `buffers`, or moved to `device`, by the caller)."""
    tensors = _object.resolve_local(obj)
    if buffers is not None:
        _buffers.check_apart(buffers, tensors, writes)
    store.fetched_here(obj.obj_id)
    done = _Done(tensors, buffers, "local", writes)
    if buffers is not None or device is not None:  # read later, by a copy
        done.hold = weakref.finalize(done, store.hold(tensors))
    return done


def _now(obj: RDTObject, plan: _Plan) -> _Done | None:
    """`plan`'s tensors where its transport has them at once (`receive_nowait`), else None.
    Device buffers wait for the caller's streams first, and the caller's for another
    fetch that writes them: never now."""
    transport, buffers, writes = plan.transport, plan.buffers, plan.writes
    if plan.ready or (writes is not None and not writes.claim_nowait()):
        return None
    try:
        with translating(f"{transport.name} fetch of {obj.obj_id}", obj.obj_id, transport=transport):
            now = transport.receive_nowait(plan.info, buffers)
    except (TransferError, ObjectFreedError) as exc:
        if not isinstance(exc, PeerDiedError) and _ray.died_on_this_node(obj.producer):
            raise _ray.died(obj, transport.name, exc) from exc  # one-sided reads on this node (shm)
        raise
    if now is None:
        return None
    if buffers is not None and not in_buffers(now, buffers):
        return _Done(now, buffers, transport.name, writes)  # a transport's own tensors: copied by the caller
    if writes is not None:
        copy_into(*writes.tied(now))  # (a tensor under two names, into two buffers)
        writes.release()  # written (where into= was given): nothing writes them any more
    return _Done(now, None, transport.name)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but this process has no usable CUDA device "
            "(torch.cuda.is_available() is False): fetch to 'cpu', or fetch in a process with a GPU"
        )


def _device_buffers(transport: Transport[Any], info: TransferInfo[Any], device: torch.device) -> list[torch.Tensor] | None:
    """Buffers on `device` for a transport that reads straight into them, else None (move after)."""
    if not transport.cross_device_buffers or device.type not in transport.devices:
        return None
    if all(torch.device(s.device) == device for s in info.specs):
        return None  # already there: the transport's own landing is as good
    with translating(f"{transport.name} fetch of {info.obj_id}", info.obj_id, transport=transport):
        transport.check_meta(info)  # first: a crafted ref reserves no device memory
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in info.specs]


def _record(obj: RDTObject, transport: str, began: float) -> None:
    if obj.specs:
        fetched.count(transport)
        _metrics.fetched(transport, obj.nbytes, time.perf_counter() - began)
        log.debug("rdt_async: fetched %s over %s (%d bytes)", obj.obj_id, transport, obj.nbytes)
