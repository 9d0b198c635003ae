"""The verbs: fetch, fetch_all, as_completed, get, put, free, wait_tensor_freed(_sync), stats, transports."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import torch

from . import _cuda, _io, _metrics, _object, _relay, _tree
from ._errors import ObjectFreedError, PeerDiedError, RDTError, TransferError, translating
from ._object import RDTObject
from ._store import log, store
from .transports import _registry
from .transports._base import SETTLE_S, TensorSpec, TransferInfo, Transport, copy_into

# Copies at most this large are done inline rather than in the pool.
INLINE_COPY_BYTES = 1 << 20


async def fetch(x: Any, /, *, device: str | torch.device | None = None, into: Any = None) -> Any:
    """Return the value of an RDT object with real tensors.

    `x` is an ObjectRef or an RDTObject (a ref to a plain value returns that value).
    `device` moves the tensors; `into` is a value, list or tensor whose tensors, in
    order, receive the object's tensors. The caller's loop never blocks; cancelling the
    fetch (or an enclosing `asyncio.timeout`) aborts the transfer.

    Runs on: consumer.
    Raises: ObjectFreedError, TransferError and its subclasses, TransportUnavailableError.
    """
    obj = await _resolve(x)
    if not isinstance(obj, RDTObject):
        return obj
    return await _fetch_object(obj, device=device, into=into)


async def fetch_all(xs: Iterable[Any], /, *, device: str | torch.device | None = None) -> list[Any]:
    """Fetch many objects concurrently; results in order. One failure cancels the rest."""
    tasks = [asyncio.ensure_future(fetch(x, device=device)) for x in xs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def as_completed(
    xs: Iterable[Any], /, *, device: str | torch.device | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """Fetch many objects concurrently; yield `(index, value)` as each lands.

    Leaving the loop early cancels the fetches still in flight.
    """
    tasks = {asyncio.ensure_future(fetch(x, device=device)): i for i, x in enumerate(xs)}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=tasks.__getitem__):
                yield tasks[t], t.result()
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def get(
    x: Any, /, *, timeout: float | None = None, device: str | torch.device | None = None, into: Any = None
) -> Any:
    """Blocking twin of `fetch`, for the driver and sync actors.

    Raises: RuntimeError on a thread that runs an event loop (use `await rdt.fetch`),
    TimeoutError after `timeout` seconds (the transfer is aborted), and what `fetch` raises.
    """
    loop = _io.running_loop()
    if loop is not None:
        raise RuntimeError(
            "rdt.get() would block the event loop running in this thread; "
            "use `await rdt.fetch(ref)` here instead"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    if _object.is_ref(x):  # resolve here: a plain ray.get beats a hop through the I/O loop
        with translating(f"resolving {x}", user_code=True):
            x = _object.get_ref(x, timeout)
        if not isinstance(x, RDTObject):
            return x  # a ref to a plain value
    elif not isinstance(x, RDTObject):
        raise _not_rdt(x, "get")
    done, value = _fetch_now(x, device=device, into=into)
    if done:
        return value
    started = _io.start(_fetch_object(x, device=device, into=into, start=value))
    fut = started.future
    try:
        return fut.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError as exc:
        if fut.done():
            raise
        fut.cancel()
        started.wait_settled(SETTLE_S)  # the transport let go: nothing writes `into` afterwards
        raise TimeoutError(f"rdt.get() timed out after {timeout} s; the transfer was aborted") from exc
    finally:
        del fut, started  # the future holds the error, whose traceback holds this frame: break the cycle


def put(value: Any, /, *, tensor_transport: str = "auto") -> Any:
    """Keep the tensors of `value` in this process and return an ObjectRef to them.

    Runs on: producer (driver or actor). Others fetch the ref like a method's result.
    Raises: ValueError for an unknown transport, TransportUnavailableError for tensors
    the transport cannot move.
    """
    _registry.check_name(tensor_transport)
    return _object.put_object(_object.produce(value, tensor_transport))


def free(x: Any, /) -> None:
    """Release an object's tensors now; later fetches raise ObjectFreedError.

    Never blocks for an RDTObject; an ObjectRef is resolved first with `ray.get` (a small
    object, but a blocking call): on an event loop, pass `await ref` instead.
    """
    obj = x if isinstance(x, RDTObject) else _object.get_ref(x, None) if _object.is_ref(x) else x
    if not isinstance(obj, RDTObject):
        raise TypeError(f"rdt.free() takes an RDT object or a ref to one, not {type(obj).__name__}")
    if obj.anchor is None:  # nothing is kept for it anywhere (inline, or no tensors)
        _object.forget(obj)
        return
    if _object.is_local(obj):
        store.free(obj.obj_id)
        return
    if obj.specs:
        _object.free_remote(obj)  # raises, marking nothing, where this process may not free it
    store.mark_freed(obj.obj_id)


async def wait_tensor_freed(tensor: torch.Tensor, /) -> None:
    """Wait until writing `tensor` in place cannot change what any consumer reads.

    That is: no object of this process holds any byte of `tensor` (every ref to them is
    gone), none is being made of it (a producing call that has returned but not finished
    its export), and no send or collective is reading it. Call it before writing a
    tensor you returned or put. Runs on: producer. Bound it with `asyncio.timeout`.
    Raises: TypeError for a non-tensor.
    """
    await store.wait_freed(_check_tensor(tensor, "wait_tensor_freed"))


def wait_tensor_freed_sync(tensor: torch.Tensor, /, *, timeout: float | None = None) -> None:
    """Blocking twin of `wait_tensor_freed`, for sync and threaded actors and the driver.

    Runs on: producer. Raises: TypeError for a non-tensor; RuntimeError on a thread that
    runs an event loop (use `await rdt.wait_tensor_freed` there); TimeoutError after
    `timeout` seconds.
    """
    _check_tensor(tensor, "wait_tensor_freed_sync")
    if _io.running_loop() is not None:
        raise RuntimeError(
            "rdt.wait_tensor_freed_sync() would block the event loop running in this thread; "
            "use `await rdt.wait_tensor_freed(tensor)` here instead"
        )
    if not store.wait_freed_blocking(tensor, timeout):
        raise TimeoutError(f"rdt.wait_tensor_freed_sync(): the tensor is still held after {timeout} s")


def _check_tensor(tensor: Any, verb: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rdt.{verb}() takes a tensor this process returned or put, not {type(tensor).__name__}")
    return tensor


def store_stats() -> dict[str, Any]:
    """Return what this process's store holds: objects, bytes, tensors, fetches by transport."""
    return store.stats()


def register_transport(name: str, devices: Sequence[str], cls: type) -> None:
    """Add a transport under `name` for tensors on `devices`, for every process of the cluster.

    `cls` is an `rdt.Transport` subclass, or a Ray `TensorTransportManager` subclass (run
    through an adapter). Call it in the driver, before or after `ray.init()` and before or
    after creating actors: every process looks the name up when it first meets it. A class
    defined in a script or test module travels by value.

    Raises: TypeError for a non-class, a class of neither kind, or one missing required
    methods (named); ValueError for a built-in or malformed name, devices that are not torch
    device types or that the class does not declare, or a name taken by another class.
    """
    _registry.register(name, devices, cls)


def available_transports() -> dict[str, bool | str]:
    """Return transport name -> True, or why it cannot be used in this process."""
    return _registry.available()


async def _resolve(x: Any) -> Any:
    if isinstance(x, RDTObject):
        return x
    if _object.is_ref(x):
        with translating(f"resolving {x}", user_code=True):
            return await _object.await_ref(x)
    raise _not_rdt(x, "fetch")


def _not_rdt(x: Any, verb: str) -> TypeError:
    return TypeError(f"rdt.{verb}() takes an ObjectRef or an RDTObject, not {type(x).__name__}")


async def _fetch_object(obj: RDTObject, *, device: Any, into: Any, start: _Start | None = None) -> Any:
    began = time.perf_counter()
    name = obj.transport  # until one is chosen
    try:
        start = start or _start(obj, into, device)
        if isinstance(start, _Done):
            tensors, buffers, name = start.tensors, start.buffers, start.transport
        else:
            transport, info, buffers, ready = start
            name = transport.name
            await _cuda.wait(ready)  # the caller's queued work on the destinations has run
            transfer = functools.partial(_transfer, obj, transport, info)
            if buffers is None and device is None and _relay.eligible(obj.specs, name, obj.producer.node_id, _node_id()):
                tensors, relayed = await _relay.fetch(obj.obj_id, obj.specs, transfer)
                name = "relay" if relayed else name
            else:
                tensors = await transfer(buffers)
            buffers = None  # written by the transport
        if buffers:
            tensors = await _copy(buffers, tensors, obj.nbytes)
        elif device is not None:
            tensors = await _move(tensors, torch.device(device), obj.nbytes)
    except BaseException as exc:
        _metrics.failed(name, exc)
        raise
    _record(obj, name, began)
    return _tree.unflatten(obj.skeleton, tensors)


async def _transfer(
    obj: RDTObject, transport: Transport[Any], info: TransferInfo[Any], buffers: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """Move the object's bytes over `transport` (into `buffers` when given)."""
    name = transport.name
    request = transport.fetch_multiple_tensors(info, buffers=buffers, channel=_object.RayChannel(obj, name))
    try:
        with translating(f"{name} fetch of {obj.obj_id}", obj.obj_id):
            return await _watched(transport.wait_fetch_complete(request), obj, name)
    except (TransferError, ObjectFreedError) as exc:
        await _raise_if_producer_died(obj, name, exc)
        raise


async def _watched(fetching: Any, obj: RDTObject, name: str) -> list[torch.Tensor]:
    """Await a transfer while watching its producer: one Ray declares dead ends it (PeerDiedError).

    A transport may wait on a peer cut off by a partition far longer than Ray takes to
    declare its host dead (a UCX read over TCP, for one): the watch starts once the
    transfer has run `_object.WATCH_AFTER_S`, and cancels it when the producer is dead.
    """
    if obj.producer.actor is None or not hasattr(obj.producer.actor, "rdt__ping"):
        return await fetching
    task = asyncio.ensure_future(fetching)
    watch = None
    try:
        await asyncio.wait({task}, timeout=_object.WATCH_AFTER_S)  # most end here: no watch made
        if not task.done():
            watch = asyncio.ensure_future(_object.watch_producer(obj.producer))
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        if watch is not None:
            watch.cancel()
        task.cancel()
        await asyncio.wait({task})  # the transport lets go of the caller's buffers first
        raise
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if watch is not None:
        watch.cancel()
    if not task.cancelled():
        return task.result()  # done (or failed) before the watch could end it
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
    if isinstance(exc, PeerDiedError) or not await _object.producer_died(obj.producer):
        return
    raise _died(obj, name, exc) from exc


def _died(obj: RDTObject, name: str, exc: RDTError) -> PeerDiedError:
    return PeerDiedError(
        f"{name} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died ({type(exc).__name__}: {exc})",
        obj_id=obj.obj_id,
    )


def _fetch_now(obj: RDTObject, *, device: Any, into: Any) -> tuple[bool, Any]:
    """Fetch on the caller's thread if nothing can block: (True, value), else (False, start)."""
    began = time.perf_counter()
    try:
        start = _start(obj, into, device)
    except BaseException as exc:
        _metrics.failed(obj.transport, exc)
        raise
    if not isinstance(start, _Done) or obj.nbytes > INLINE_COPY_BYTES:
        return False, start  # the transfer (or a large copy) belongs to the I/O loop
    tensors, buffers = start.tensors, start.buffers
    if buffers:
        tensors = copy_into(buffers, tensors)
    elif device is not None:
        tensors = [t.to(device) for t in tensors]
    _record(obj, start.transport, began)
    return True, _tree.unflatten(obj.skeleton, tensors)


@dataclasses.dataclass
class _Done:
    """A fetch whose tensors were had at once: `buffers` are still to be filled."""

    tensors: list[torch.Tensor]
    buffers: list[torch.Tensor] | None
    transport: str


# What `_start` leaves: tensors had at once, or the transport, info and buffers to transfer
# with, and events on the caller's streams that the transfer waits for before it writes.
_Start = _Done | tuple[Transport[Any], TransferInfo[Any], list[torch.Tensor] | None, list[Any]]


def _start(obj: RDTObject, into: Any, device: Any = None) -> _Start:
    """Check the fetch and do what needs no waiting; else return what to transfer with."""
    if store.was_freed(obj.obj_id):
        raise ObjectFreedError(f"object {obj.obj_id} was freed", obj_id=obj.obj_id)
    buffers = _buffers(obj, into)
    if device is not None:
        _check_device(torch.device(device))
    if not obj.specs:
        return _Done([], None, "none")
    if _object.is_local(obj):
        tensors = _object.resolve_local(obj)
        _warn_local(obj.obj_id)
        return _Done(tensors, buffers, "local")
    name, meta = _object.choose_transport(obj, _node_id())
    transport = _registry.get(name)
    if buffers is None and device is not None:
        buffers = _device_buffers(obj, transport, torch.device(device))
    info = TransferInfo(obj.obj_id, obj.specs, meta, hold=obj)
    ready = _cuda.record(buffers or ())
    if not ready:  # device buffers wait for the caller's streams first: never now
        try:
            with translating(f"{name} fetch of {obj.obj_id}", obj.obj_id):
                now = transport.receive_nowait(info, buffers)
        except (TransferError, ObjectFreedError) as exc:
            if not isinstance(exc, PeerDiedError) and _object.died_on_this_node(obj.producer):
                raise _died(obj, name, exc) from exc  # one-sided reads on this node (shm)
            raise
        if now is not None:
            return _Done(now, None, name)
    return transport, info, buffers, ready


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but this process has no usable CUDA device "
            "(torch.cuda.is_available() is False): fetch to 'cpu', or fetch in a process with a GPU"
        )


def _device_buffers(obj: RDTObject, transport: Transport[Any], device: torch.device) -> list[torch.Tensor] | None:
    """Buffers on `device` for a transport that reads straight into them, else None (move after)."""
    if not transport.cross_device_buffers or device.type not in transport.devices:
        return None
    if all(torch.device(s.device) == device for s in obj.specs):
        return None  # already there: the transport's own landing is as good
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in obj.specs]


def _record(obj: RDTObject, transport: str, began: float) -> None:
    if obj.specs:
        store.fetches[transport] += 1
        _metrics.fetched(transport, obj.nbytes, time.perf_counter() - began)
        log.debug("rdt_async: fetched %s over %s (%d bytes)", obj.obj_id, transport, obj.nbytes)


def _buffers(obj: RDTObject, into: Any) -> list[torch.Tensor] | None:
    if into is None:
        return None
    skeleton, bufs = _tree.flatten(into)
    if not bufs and obj.specs:
        raise TypeError(f"into= holds no tensor ({type(into).__name__} {skeleton!r}); pass the tensors to receive into")
    if len(bufs) != len(obj.specs):
        raise ValueError(
            f"into= holds {len(bufs)} tensor(s) but the object has {len(obj.specs)}: "
            f"{', '.join(map(str, obj.specs))}"
        )
    for i, (b, s) in enumerate(zip(bufs, obj.specs)):
        if tuple(b.shape) != s.shape or b.dtype != s.dtype:
            raise ValueError(f"into= tensor {i} is {TensorSpec.of(b)}; the object's tensor {i} is {s}")
    return bufs


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


def _node_id() -> str:
    return _object.node_id()


def _warn_local(obj_id: str) -> None:
    """Warn, once per object, where a local fetch meets a send to another process (as Ray does).

    Only two-sided sends are known here; one-sided readers (nixl) are not seen.
    """
    stored = store.get(obj_id)
    if stored is None:
        return
    stored.fetched_here = True
    if stored.served and not stored.warned:
        stored.warned = True
        warnings.warn(_object.shared_with_producer(obj_id), UserWarning, stacklevel=_caller_level())


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _caller_level() -> int:
    """The stacklevel of the first frame outside rdt_async: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
