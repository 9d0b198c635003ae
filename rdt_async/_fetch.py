"""The fetch pipeline: check, choose the transport (`_choose`), transfer (through the node relay where it
pays), watch the producer, land the tensors where the caller asked.

Runs on: consumer. The verbs in `_api.py` call `fetch_object` (a loop) and `fetch_now`
(a thread that may not block: what needs no waiting).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from . import _buffers, _cuda, _io, _metrics, _object, _ray, _relay, _tree
from ._avoid import avoided, unusable
from ._choose import address_of, asked_transport, choose_transport
from ._errors import (
    CollectiveGroupError,
    ObjectFreedError,
    PeerDiedError,
    RDTError,
    TransferError,
    TransportUnavailableError,
    release_frames,
    translating,
)
from ._fetched import fetched
from ._local import copy_into, in_buffers
from ._object import RDTObject
from ._store import log, shared_with_producer, store
from .transports import _registry
from .transports._base import FetchRequest, TensorSpec, TransferInfo, Transport


def _relayed(obj: RDTObject, transport: str, buffers: list[torch.Tensor] | None) -> bool:
    """Whether this fetch goes through the node relay (into `buffers` in this process's memory, if any)."""
    if buffers is not None and not all(b.device.type == "cpu" for b in buffers):
        return False
    return _relay.eligible(obj.specs, transport, obj.producer.node_id, _ray.node_id())


# Copies at most this large are done inline rather than in the pool.
INLINE_COPY_BYTES = 1 << 20


async def fetch_object(
    obj: RDTObject, *, device: Any, into: Any, start: _Start | None = None, tensor_transport: str | None = None
) -> Any:
    """Return `obj`'s value with its tensors here (`start`: what `fetch_now` left to do;
    `tensor_transport`: the one the consumer asked for, else the producer's choice).

    Records the fetch (store stats, Ray metrics) and what failed it.
    """
    began = time.perf_counter()
    name = obj.transport  # until one is chosen
    writes = None  # the `into=` buffers' bytes, claimed until nothing writes them
    try:
        start = start or await _started(obj, into, device, tensor_transport)
        writes = start.writes if isinstance(start, _Done) else start[4]
        if writes is not None:
            await writes.claim()  # (at once, unless another fetch writes these buffers: until it ends)
        if isinstance(start, _Done):
            tensors, buffers, name = start.tensors, start.buffers, start.transport
        else:
            transport, info, buffers, ready, _ = start
            name = transport.name
            await _cuda.wait(ready)  # the caller's queued work on the destinations has run
            if device is None and _relayed(obj, name, buffers):
                # The first consumer of the node lands the bytes in a memfd it hands over
                # (DIRECT: also with `into=` where a warm one is there, so that the others map it
                # as soon as the read ends), else in its `into=` buffers or where its transport puts
                # them; the others map the memfd, and those with `into=` copy from it.
                used = [name]  # the path the read took, where auto fell back (`_fetch_over`)
                transfer = functools.partial(_fetch_over, obj, transport, info, buffers, used, tensor_transport, writes=writes)
                direct = transport.fills_buffers
                into = functools.partial(_fetch_over, obj, transport, info, used=used, asked=tensor_transport) if direct else None
                tensors, relayed = await _relay.fetch(
                    _relay.name_of(obj.obj_id, obj.producer, name, obj.specs, info.meta), obj.specs, _only(transfer), _only(into), warm_only=buffers is not None,
                    source=_relay.source_of(obj.producer.node_id, obj.producer.pid), buffers=buffers,
                )
                name = "relay" if relayed else used[0]
            else:
                tensors, name = await _fetch_over(obj, transport, info, buffers, asked=tensor_transport, writes=writes)
            if buffers is not None and in_buffers(tensors, buffers):
                buffers = None  # written (a transport that handed back tensors of its own: copied below)
        if buffers:
            tensors = await _copy(buffers, tensors, obj.nbytes)
        elif device is not None:
            tensors = await _move(tensors, torch.device(device), obj.nbytes)
        if writes is not None and writes.copies:  # a tensor under two names, into two buffers
            await _copy(*writes.tied(tensors), obj.nbytes)
    except BaseException as exc:
        _metrics.failed(name, exc)
        if isinstance(exc, PeerDiedError):
            _lost(obj)
        release_frames(exc)
        del exc  # (a cycle through this frame otherwise: see _api._all_or_none)
        raise
    finally:
        if isinstance(start, _Done):
            start.release()  # (its writes, and its hold on a same-process object's tensors)
        elif writes is not None:
            writes.release()
    _record(obj, name, began)
    return _tree.unflatten(obj.skeleton, tensors)


def abandon(start: Any) -> None:
    """Let go of what `fetch_now` left (`start`) where `fetch_object` never ran it (a
    `rdt.get` timed out or interrupted before the fetch began): the claim on its `into=`
    buffers (another fetch into them waited for good) and its hold."""
    if isinstance(start, _Done):
        start.release()
    elif isinstance(start, tuple) and start[4] is not None:
        start[4].release()


async def _started(obj: RDTObject, into: Any, device: Any, asked: str | None) -> _Start:
    """`_start`, where a group both ends share is broken: the producer's death may be
    why, and then that is the error (asked of Ray; a producer on another node cannot be
    seen to die from here)."""
    try:
        return _start(obj, into, device, asked)
    except CollectiveGroupError as exc:
        await _raise_if_producer_died(obj, obj.transport, exc)
        raise


def _lost(obj: RDTObject) -> None:
    """A fetch from `obj`'s producer ended in PeerDiedError: remember it, and let the
    transports here let go of what they keep for that producer (connections, metadata)."""
    _ray.lost(obj.producer)
    for transport in _registry.created():
        try:
            transport.peer_gone(obj.producer.node_id, obj.producer.pid)
        except Exception:  # letting go is best effort: the fetch's own error is what counts
            log.warning("rdt_async: %s could not let go of %s", transport.name, obj.producer.label, exc_info=True)


def _info(obj: RDTObject, meta: Any) -> TransferInfo[Any]:
    """What a transport is told of `obj` to fetch it with `meta`."""
    return TransferInfo(obj.obj_id, obj.specs, meta, hold=obj, producer_pid=obj.producer.pid, producer_node=obj.producer.node_id)


async def _fetch_over(
    obj: RDTObject,
    transport: Transport[Any],
    info: TransferInfo[Any],
    buffers: list[torch.Tensor] | None = None,
    used: list[str] | None = None,
    asked: str | None = None,
    landed: Callable[[int, int, int], None] | None = None,
    writes: _buffers.Writes | None = None,
) -> tuple[list[torch.Tensor], str]:
    """`_transfer`, and where `auto` chose a path that cannot be used with this producer,
    the next candidate, and at the last the object store. Return the tensors and the path.
    `landed`: told of each range of `buffers` as it lands, where the transport says so
    (`Transport.reports_landed`; a fallback's transport may not). `writes`: the claim on
    the caller's `buffers` (`_transfer`).

    The one fallback of a fetch: the reason goes into `store_stats()["auto"]`, is logged
    once per node and path, and `auto` leaves a path that could not reach a node out of
    that node's fetches for `_avoid.AVOID_S`; where the next path fails too, its error
    says why each path before it could not be used. A transport named explicitly, by the
    producer or by the consumer (`asked`), fails instead.
    """
    chosen = asked or obj.transport
    fell_back: list[tuple[str, str]] = []
    if landed is not None and buffers is not None and transport.reports_landed:
        info = dataclasses.replace(info, landed=landed)
    while True:
        try:
            tensors = await _transfer(obj, transport, info, buffers, writes)
        except (TransportUnavailableError, TransferError) as exc:
            why = unusable(exc) if chosen == _registry.AUTO else None
            if why is not None and transport.name != _registry.FALLBACK:
                avoided.note(obj.producer, transport.name, exc, why, address_of(type(transport), info.meta))
                without = frozenset(t for t, _ in fell_back) | {transport.name}
                auto = obj if obj.transport == _registry.AUTO else dataclasses.replace(obj, transport=_registry.AUTO)
                name, meta = choose_transport(auto, _ray.node_id(), without=without, fell_back=(*fell_back, (transport.name, why)))
                if name not in without:
                    fell_back.append((transport.name, why))
                    transport = _registry.transport(name)
                    info = _info(obj, meta)
                    del exc
                    continue
            told = _after(exc, transport.name, fell_back)  # (no next path: this error, with why the others failed)
            if told is not exc:
                raise told from exc
            raise
        if used is not None:
            used[0] = transport.name
        return tensors, transport.name


def _after(exc: RDTError, name: str, fell_back: list[tuple[str, str]]) -> RDTError:
    """`exc`, raised by `name` where `auto` fell back to it, saying why each path before it
    could not be used: the first one's reason names the address and the setting to change,
    which the last path's error (the object store of a driver's put, say) does not. `exc`
    itself where `auto` fell back to no path before it."""
    if not fell_back:
        return exc
    tried = "; ".join(f"{path}: {why[:1000]}" for path, why in fell_back)
    try:  # (a new error: the one raised may be another fetch's too)
        return type(exc)(f"{exc} (auto took {name} after: {tried})", obj_id=exc.obj_id)
    except Exception:  # a transport's own error type that is not built so: as it is
        return exc


def _only(
    fetch: Any,
) -> Any:
    """`_fetch_over` as the relay calls a transfer: the tensors alone."""
    if fetch is None:
        return None

    async def tensors(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return (await fetch(*args, **kwargs))[0]  # type: ignore[no-any-return]

    return tensors


async def _transfer(
    obj: RDTObject,
    transport: Transport[Any],
    info: TransferInfo[Any],
    buffers: list[torch.Tensor] | None,
    writes: _buffers.Writes | None = None,
) -> list[torch.Tensor]:
    """Move the object's bytes over `transport` (into `buffers` when given, whose claim
    `writes` is kept until the transfer has let go of them)."""
    name = transport.name
    request = FetchRequest.start(transport, info, buffers=buffers, channel=_ray.RayChannel(obj, name))
    try:
        with translating(f"{name} fetch of {obj.obj_id}", obj.obj_id, transport=transport):
            return await _watched(request.wait(), obj, name)
    except (TransferError, ObjectFreedError) as exc:
        await _raise_if_producer_died(obj, name, exc)
        raise
    finally:
        if writes is not None and not request.settled.done():  # given up on (`_io.SETTLE_S`): it may write yet
            writes.release_after(request.settled)


async def _watched(fetching: Awaitable[list[torch.Tensor]], obj: RDTObject, name: str) -> list[torch.Tensor]:
    """Await a transfer while watching its producer: one Ray declares dead ends it (PeerDiedError).

    A transport may wait on a peer cut off by a partition far longer than Ray takes to
    declare its host dead (a UCX read over TCP, for one): the watch starts once the
    transfer has run `_ray.WATCH_AFTER_S`, and cancels it when the producer is dead.
    """
    if not obj.producer.serves:
        return await fetching
    task = asyncio.ensure_future(fetching)
    watch = None
    try:
        await asyncio.wait({task}, timeout=_ray.WATCH_AFTER_S)  # most end here: no watch made
        if not task.done():
            watch = asyncio.ensure_future(_ray.watch_producer(obj.producer))
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and watch.exception() is not None:  # the watch failed: no verdict
                log.warning(
                    "rdt_async: could not watch %s during the %s fetch of %s (%r); waiting for the transfer alone",
                    obj.producer.label, name, obj.obj_id, watch.exception(),
                )
                watch = None
                await asyncio.wait({task})
    except asyncio.CancelledError:
        if watch is not None:
            watch.cancel()
        task.cancel()
        await _io.shielded(task)  # the transport lets go of the caller's buffers first, through any cancel
        raise
    cancelled = False
    if not task.done():
        task.cancel()
        cancelled = await _io.shielded(task)
    if watch is not None:
        watch.cancel()
    if cancelled:
        raise asyncio.CancelledError
    if not task.cancelled():
        result: list[torch.Tensor] = task.result()  # done (or failed) before the watch could end it
        return result
    raise PeerDiedError(
        f"{name} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died or its host was cut "
        "off during the transfer (Ray declared it dead)",
        obj_id=obj.obj_id,
    )


async def _raise_if_producer_died(obj: RDTObject, name: str, exc: RDTError) -> None:
    """A fetch failed: if its producer is dead, that is what the caller needs to know.

    Transports see a death in their own terms (Gloo: "Connection closed by peer", the
    object store: the object lost); callers branch on PeerDiedError (retry elsewhere)
    versus the rest, so every transport's failure is checked against the producer's life.
    """
    if isinstance(exc, PeerDiedError) or not await _ray.producer_died(obj.producer):
        return
    raise _died(obj, name, exc) from exc


def _died(obj: RDTObject, name: str, exc: RDTError) -> PeerDiedError:
    return PeerDiedError(
        f"{name} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died ({type(exc).__name__}: {exc})",
        obj_id=obj.obj_id,
    )


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
    if not isinstance(start, _Done) or obj.nbytes > INLINE_COPY_BYTES:
        return False, start  # the transfer (or a large copy) belongs to the I/O loop
    tensors, buffers, writes = start.tensors, start.buffers, start.writes
    if writes is not None and not writes.claim_nowait():
        return False, start  # another fetch writes these buffers: wait for it on a loop
    try:
        if buffers:
            tensors = copy_into(buffers, tensors)
        elif device is not None:
            tensors = [t.to(device) for t in tensors]
        if writes is not None:  # a tensor under two names, into two buffers
            copy_into(*writes.tied(tensors))
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


# What `_start` leaves: tensors had at once, or the transport, info and buffers to transfer
# with, and events on the caller's streams that the transfer waits for before it writes;
# and the bytes of the caller's buffers, claimed before they are written (`_buffers.Writes`).
_Start = _Done | tuple[Transport[Any], TransferInfo[Any], list[torch.Tensor] | None, list[Any], _buffers.Writes | None]


def _start(obj: RDTObject, into: Any, device: Any = None, asked: str | None = None) -> _Start:
    """Check the fetch and do what needs no waiting; else return what to transfer with
    (over the transport the consumer `asked` for, if any)."""
    _object.check(obj)  # everything a ref carries came from another process
    if store.was_freed(obj.obj_id):
        raise ObjectFreedError(f"object {obj.obj_id} was freed", obj_id=obj.obj_id)
    buffers, writes = _buffers.checked_writes(obj.specs, into, obj.skeleton)  # before anything moves
    try:
        return _begin(obj, buffers, writes, device, asked)
    except BaseException:
        if writes is not None:
            writes.release()
        raise


def _begin(
    obj: RDTObject, buffers: list[torch.Tensor] | None, writes: _buffers.Writes | None, device: Any, asked: str | None
) -> _Start:
    """`_start`, once the buffers are checked."""
    if device is not None:
        _check_device(torch.device(device))
    if not obj.specs:
        return _Done([], None, "none")
    if _object.is_local(obj):
        tensors = _object.resolve_local(obj)
        _check_local(obj, tensors)
        if buffers is not None:
            _buffers.check_apart(buffers, tensors, writes)
        _warn_local(obj.obj_id)
        done = _Done(tensors, buffers, "local", writes)
        if buffers is not None or device is not None:  # read later, by a copy
            done.hold = weakref.finalize(done, store.hold(tensors))
        return done
    if buffers is not None:
        _buffers.check_unheld(*_buffers.every(buffers, writes))
    _ray.hand_node_ip()  # before a transport first connects (UCX keeps to this address's interface)
    name, meta = choose_transport(obj, _ray.node_id()) if asked is None else asked_transport(obj, asked, _ray.node_id())
    transport = _registry.transport(name)
    _check_devices(obj, transport)
    info = _info(obj, meta)
    if buffers is None and device is not None:
        buffers = _device_buffers(transport, info, torch.device(device))
    ready = _cuda.record(buffers or ())
    # Device buffers wait for the caller's streams first, and the caller's for another
    # fetch that writes them: never now.
    if not ready and (writes is None or writes.claim_nowait()):
        try:
            with translating(f"{name} fetch of {obj.obj_id}", obj.obj_id, transport=transport):
                now = transport.receive_nowait(info, buffers)
        except (TransferError, ObjectFreedError) as exc:
            if not isinstance(exc, PeerDiedError) and _ray.died_on_this_node(obj.producer):
                raise _died(obj, name, exc) from exc  # one-sided reads on this node (shm)
            raise
        if now is not None:
            if buffers is not None and not in_buffers(now, buffers):
                return _Done(now, buffers, name, writes)  # a transport's own tensors: copied by the caller
            if writes is not None:
                copy_into(*writes.tied(now))  # (a tensor under two names, into two buffers)
                writes.release()  # written (where into= was given): nothing writes them any more
            return _Done(now, None, name)
    return transport, info, buffers, ready, writes


def _check_local(obj: RDTObject, tensors: list[torch.Tensor]) -> None:
    """Refuse a ref naming an object of this process with specs other than its tensors'
    (the ref came from elsewhere: a copy into `into=` would broadcast and convert).
    Raises: TransferError naming the first that differs."""
    if len(tensors) != len(obj.specs):
        raise TransferError(
            f"the ref names object {obj.obj_id}, which this process produced, with {len(obj.specs)} "
            f"tensor(s); it has {len(tensors)}: the ref was altered"
        )
    for k, (t, spec) in enumerate(zip(tensors, obj.specs)):
        if TensorSpec.of(t) != spec:
            raise TransferError(
                f"the ref names object {obj.obj_id}, which this process produced, and says its tensor {k} is "
                f"{spec}; it is {TensorSpec.of(t)}: the ref was altered"
            )


def _check_devices(obj: RDTObject, transport: Transport[Any]) -> None:
    """Refuse specs on devices the transport does not move (no producer returns them over it,
    `Transport.check_tensors`; a ref's `meta` device came back from the object store as
    tensors without bytes). Raises: TransferError."""
    moves = transport.devices
    for k, spec in enumerate(obj.specs):
        if spec.device.partition(":")[0] not in moves:
            raise TransferError(
                f"object {obj.obj_id}: its tensor {k} is said to be on {spec.device}, which transport "
                f"{transport.name!r} does not move ({', '.join(moves)}): no producer sends that; the ref was altered",
                obj_id=obj.obj_id,
            )


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


async def _copy(buffers: list[torch.Tensor], tensors: list[torch.Tensor], nbytes: int) -> list[torch.Tensor]:
    return await _off_caller_streams(copy_into, buffers, tensors, nbytes=nbytes)


async def _move(tensors: list[torch.Tensor], device: torch.device, nbytes: int) -> list[torch.Tensor]:
    if all(t.device == device for t in tensors):
        return tensors
    return await _off_caller_streams(lambda ts: [t.to(device) for t in ts], tensors, nbytes=nbytes)


async def _off_caller_streams(fn: Any, *args: Any, nbytes: int) -> list[torch.Tensor]:
    """Run a copy inline when small, else in the pool; device results are ready on return.

    A copy on the caller's own thread is ordered on its streams. One on the I/O loop
    (`rdt.get`) or in the pool is not, so it has finished before the caller sees it.
    """
    if nbytes > INLINE_COPY_BYTES:
        return await _io.to_thread_finished(_cuda.settled, fn, *args)
    out: list[torch.Tensor] = fn(*args)
    if _io.on_io_thread():
        await _cuda.wait(_cuda.record(out))
    return out


# Where the user's code asked for the fetch (file, line, module globals), where the fetch
# runs in a task whose frames lead back to asyncio or Ray, not to that line: set by
# `fetch_all` and `as_completed` (the user's line) and a method's fetched arguments (its
# definition).
CALLER: contextvars.ContextVar[tuple[str, int, dict[str, Any]] | None] = contextvars.ContextVar(
    "rdt_caller", default=None
)


def _warn_local(obj_id: str) -> None:
    """Warn, once per object, where a local fetch meets a send to another process (as Ray
    does): at `CALLER`, else at the first frame outside rdt_async (the user's line for a
    direct `await rdt.fetch` or `rdt.get`).

    Only two-sided sends are known here; one-sided readers (nixl) are not seen.
    """
    stored = store.get(obj_id)
    if stored is None:
        return
    stored.fetched_here = True
    if not stored.served or stored.warned:
        return
    stored.warned = True
    where = CALLER.get() or user_line()
    if where is None:
        warnings.warn(shared_with_producer(obj_id), UserWarning, stacklevel=1)  # (no frame of the user on this stack)
        return
    filename, lineno, module_globals = where
    warnings.warn_explicit(
        shared_with_producer(obj_id), UserWarning, filename, lineno,
        module=module_globals.get("__name__"), registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_line() -> tuple[str, int, dict[str, Any]] | None:
    """(file, line, module globals) of the first frame outside rdt_async on this stack."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)
