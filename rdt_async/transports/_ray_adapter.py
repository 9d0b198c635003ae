"""Ray's `TensorTransportManager` classes, run as rdt_async transports.

A transport written for Ray (a subclass of `ray.experimental.rdt.TensorTransportManager`)
is registered with `rdt.register_transport(name, devices, cls)` like any other; the
registry wraps it in a subclass of `RayManagerTransport`. Ray's interface is
synchronous, so every call into the manager runs in rdt_async's bounded pool, never on
an event loop. Where each of Ray's methods runs in a transfer::

    producer                                       consumer
    --------                                       --------
    extract_tensor_transport_metadata  (prepare)
        -> RayMeta(its metadata, producer actor)   travels inside the RDTObject
                                                   get_communicator_metadata(src, dst, name)
                                                   fetch_multiple_tensors + wait_fetch_complete
                                                       (receive(): the pool, from the I/O loop)
    [two-sided only, asked over the Channel, concurrently with the receive]
    send_multiple_tensors(tensors, meta, comm)
    abort_transport(obj_id, comm)    on cancel,    abort_transport(obj_id, comm)
                                     if can_abort_transport()
    garbage_collect(obj_id, meta, tensors)  when the last ref is gone, or on free()

Differences from Ray: `get_communicator_metadata` runs on the consumer, which knows both
actors (Ray runs it on the object's owner); `tensor_transport_backend` and
`actor_has_tensor_transport` are never called (the registered name is the name, and
every process can load every registered transport). A manager whose
`can_abort_transport()` is False cannot be interrupted: a cancelled fetch returns at once
and the receive finishes in the pool, its result dropped; one that can is waited for
ABORT_WAIT_S at most. So a manager never receives into the caller's `into=` buffers
themselves: into memory of its own, copied into them once all of it has landed, and
nothing writes them after the fetch has returned or raised.

This module imports nothing from Ray: it only calls the manager class it is given and,
to name the actors, looks Ray up in `sys.modules`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import _cuda, _io
from .._errors import TransferError, TransportUnavailableError
from .._local import copy_into, in_buffers
from ._base import Channel, TensorSpec, TransferInfo, Transport
from ._kit import local_device

log = logging.getLogger("rdt_async")

# How long a cancelled fetch waits for the manager's abort and for its receive to return.
ABORT_WAIT_S = 5.0


@dataclass(frozen=True)
class RayMeta:
    """What an RDTObject carries for a Ray manager: its metadata and the producer actor."""

    transport_meta: Any  # the manager's TensorTransportMetadata
    src_actor: Any = None  # ActorHandle of the producer; None for the driver or a plain process


@dataclass(frozen=True)
class _Describe:
    """Ask the producer for metadata made for this transfer only (object not prepared)."""

    token: str


@dataclass(frozen=True)
class _Send:
    comm: Any
    token: str | None = None  # a _Describe's token: release its metadata after the send


@dataclass(frozen=True)
class _Abort:
    comm: Any
    token: str | None = None


def adapt(name: str, devices: tuple[str, ...], manager_class: type) -> type[RayManagerTransport]:
    """Return a Transport class running `manager_class` under `name`. Runs on: both."""
    namespace = {
        "name": name,
        "devices": devices,
        "one_sided": bool(manager_class.is_one_sided()),  # type: ignore[attr-defined]
        "can_abort": bool(manager_class.can_abort_transport()),  # type: ignore[attr-defined]
        "manager_class": _concrete(manager_class),
        "__module__": __name__,
        "__qualname__": f"RayManagerTransport[{manager_class.__qualname__}]",
    }
    return type(f"{manager_class.__name__}Transport", (RayManagerTransport,), namespace)


def _concrete(cls: type) -> type:
    """Fill the abstract methods the adapter never calls (the registry checked which)."""
    missing: frozenset[str] = getattr(cls, "__abstractmethods__", frozenset())
    if not missing:
        return cls
    return type(cls)(cls.__name__, (cls,), {m: _never_called(cls, m) for m in missing})


def _never_called(cls: type, method: str) -> Any:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{cls.__qualname__}.{method} is not implemented")

    return stub


class RayManagerTransport(Transport[RayMeta]):
    """A Ray TensorTransportManager behind rdt_async's Transport interface."""

    manager_class: ClassVar[type]
    inline_prepare_bytes = 0  # Ray's extract may block (memory registration): never inline

    def __init__(self) -> None:
        self._manager = self.manager_class()
        self._lock = threading.Lock()
        # Producer: the tensors of each prepared object, which Ray's garbage_collect takes.
        self._held: dict[str, list[torch.Tensor]] = {}
        # Producer: metadata made for one transfer of an object that was not prepared.
        self._lent: dict[str, tuple[str, Any, list[torch.Tensor]]] = {}
        # Producer: tokens whose consumer gave up before their _Describe was served (bounded).
        self._given_up: dict[str, bool] = {}

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> RayMeta:
        """Run the manager's extract_tensor_transport_metadata. Runs on: producer."""
        tensors = list(tensors)
        meta = self._manager.extract_tensor_transport_metadata(obj_id, tensors)
        with self._lock:
            self._held[obj_id] = tensors
        return RayMeta(meta, _current_actor())

    def garbage_collect(self, obj_id: str, meta: RayMeta) -> None:
        """Hand the manager's garbage_collect to the pool. Runs on: producer."""
        with self._lock:
            tensors = self._held.pop(obj_id, None)
        if tensors is not None:
            _io.pool().submit(self._collect, obj_id, meta.transport_meta, tensors)

    def _collect(self, obj_id: str, transport_meta: Any, tensors: list[torch.Tensor]) -> None:
        try:
            self._manager.garbage_collect(obj_id, transport_meta, tensors)
        except Exception:  # the object is gone either way; say why its resources may not be
            log.exception("rdt_async: %s garbage_collect of %s failed", self.name, obj_id)

    async def receive(
        self, info: TransferInfo[RayMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        """Receive in the pool; two-sided: ask the producer to send meanwhile.

        Runs on: consumer (I/O loop). Cancelling aborts both sides if the manager can.
        """
        meta, token = info.meta, None
        if meta is not None:
            _check_meta(info, meta)
        elif self.one_sided:
            raise TransportUnavailableError(
                f"object {info.obj_id} carries no {self.name!r} metadata", obj_id=info.obj_id
            )
        else:
            token = secrets.token_hex(8)
        try:
            if token is not None:
                meta = await channel.request_send(_Describe(token))
                _check_meta(info, meta)
            comm = await _io.to_thread(
                self._manager.get_communicator_metadata, meta.src_actor, _current_actor(), self.name
            )
        except BaseException:
            if token is not None:  # what the producer made for this transfer goes back (no wait)
                asyncio.ensure_future(channel.request_send(_Abort(None, token))).add_done_callback(_retrieve)
            raise
        # Its own memory, not the caller's buffers: a receive left running (no abort, or one
        # past ABORT_WAIT_S) would write them after this fetch ended.
        scratch = None if buffers is None else [torch.empty(b.shape, dtype=b.dtype, device=b.device) for b in buffers]
        if buffers is None and self.one_sided:
            # A one-sided manager may hand back views of the producer's memory (Ray's CUDA
            # IPC manager does), which the producer writes once its refs are gone: the
            # consumer's tensors are its own, as over every transport but shm (copied into
            # these where the manager does not land in them).
            scratch = [torch.empty(s.shape, dtype=s.dtype, device=local_device(s.device)) for s in info.specs]
        recv = asyncio.wrap_future(
            _io.pool(_io.ADAPTER).submit(self._recv, info.obj_id, meta.transport_meta, comm, scratch)
        )
        work = {recv}
        if not self.one_sided:
            work.add(asyncio.ensure_future(channel.request_send(_Send(comm, token))))
        try:
            done, _ = await asyncio.wait(work, return_when=asyncio.FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            got = _checked(info, recv.result(), self.name)
            mine = buffers if buffers is not None else scratch  # the tensors the caller gets: its own
            if mine is None or in_buffers(got, mine):
                return got
            return await _io.to_thread_finished(_cuda.settled, copy_into, mine, got)
        except BaseException:
            await self._abort(info.obj_id, comm, recv, channel, token)
            raise
        finally:
            for fut in work:  # a side left running must not log "exception never retrieved"
                fut.add_done_callback(_retrieve)

    def _recv(
        self, obj_id: str, transport_meta: Any, comm: Any, buffers: list[torch.Tensor] | None
    ) -> list[Any]:
        request = self._manager.fetch_multiple_tensors(obj_id, transport_meta, comm, buffers)
        return list(self._manager.wait_fetch_complete(request))

    async def _abort(
        self, obj_id: str, comm: Any, recv: asyncio.Future[Any], channel: Channel, token: str | None
    ) -> None:
        if not self.can_abort:
            if token is not None and not recv.done():
                log.warning("rdt_async: %s cannot abort; the transfer of %s runs on", self.name, obj_id)
            return
        loop = asyncio.get_running_loop()
        # Its own pool: the receives' may be full of blocked receives.
        steps: list[Any] = [loop.run_in_executor(_io.pool(_io.ABORTS), self._manager.abort_transport, obj_id, comm)]
        if not self.one_sided:
            steps.append(asyncio.ensure_future(channel.request_send(_Abort(comm, token))))
        # Cancelled again while aborting: the abort goes on, the first error wins.
        await _io.shielded(asyncio.wait([*steps, recv]), timeout=ABORT_WAIT_S)
        for step in steps:
            step.add_done_callback(_retrieve)

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: RayMeta | None, request: Any
    ) -> Any:
        """Serve a consumer's request: describe, send or abort. Runs on: producer (I/O loop)."""
        if isinstance(request, _Describe):
            transport_meta = await _io.to_thread(
                self._manager.extract_tensor_transport_metadata, obj_id, list(tensors)
            )
            with self._lock:
                self._lent[request.token] = (obj_id, transport_meta, list(tensors))
                given_up = self._given_up.pop(request.token, False)
            if given_up:  # its consumer gave up before this arrived (its _Abort came first)
                self._give_back(request.token)
            return RayMeta(transport_meta, _current_actor())
        if isinstance(request, _Abort):
            if request.comm is None:  # the consumer gave up before its transfer started
                with self._lock:
                    if request.token is not None and request.token not in self._lent:
                        self._given_up[request.token] = True
                        while len(self._given_up) > 4096:
                            self._given_up.pop(next(iter(self._given_up)))
                self._give_back(request.token)
                return None
            try:
                if self.can_abort:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(_io.pool(_io.ABORTS), self._manager.abort_transport, obj_id, request.comm)
            finally:
                self._give_back(request.token)
            return None
        if not isinstance(request, _Send):
            raise TypeError(f"{self.name}: unexpected request {request!r}")
        try:
            if meta is not None:
                transport_meta = meta.transport_meta
            else:
                with self._lock:
                    lent = self._lent.get(request.token or "")
                if lent is None:
                    raise TransportUnavailableError(
                        f"{self.name}: no metadata for object {obj_id}", obj_id=obj_id
                    )
                transport_meta = lent[1]
            return await _io.to_thread(
                self._manager.send_multiple_tensors, list(tensors), transport_meta, request.comm
            )
        finally:
            self._give_back(request.token)

    def _give_back(self, token: str | None) -> None:
        with self._lock:
            lent = self._lent.pop(token, None) if token is not None else None
        if lent is not None:
            _io.pool().submit(self._collect, *lent)


def _check_meta(info: TransferInfo[Any], meta: Any) -> None:
    """Raise TransferError unless `meta` is a RayMeta whose tensors (where the manager's
    metadata lists them, as Ray's `tensor_meta`) are the ref's. Runs on: consumer."""
    why = None
    if not isinstance(meta, RayMeta):
        why = f"its metadata is a {type(meta).__name__}, not RayMeta"
    else:
        listed = getattr(meta.transport_meta, "tensor_meta", None)
        if isinstance(listed, (list, tuple)):
            try:
                shapes = [(tuple(shape), dtype) for shape, dtype in listed]
            except (TypeError, ValueError):
                shapes = None
            if shapes != [(s.shape, s.dtype) for s in info.specs]:
                why = f"its manager's tensor_meta lists {_shown(shapes)}, the ref's tensors are {_shown(info.specs)}"
    if why is not None:
        raise TransferError(
            f"fetch of {info.obj_id}: the ref's transport metadata is not this object's ({why}); "
            "nothing was received. Pass refs as rdt_async hands them out, unaltered",
            obj_id=info.obj_id,
        )


def _checked(info: TransferInfo[Any], tensors: list[Any], name: str) -> list[torch.Tensor]:
    """Return the manager's tensors if they are the ref's (count, shape, dtype), else raise TransferError."""
    for i, (t, spec) in enumerate(zip(tensors, info.specs)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            got = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TransferError(
                f"{name} fetch of {info.obj_id}: the manager returned {got} for tensor {i} ({spec}); "
                "its metadata does not describe this object",
                obj_id=info.obj_id,
            )
    if len(tensors) != len(info.specs):
        raise TransferError(
            f"{name} fetch of {info.obj_id}: the manager returned {len(tensors)} tensor(s) for "
            f"{len(info.specs)}; its metadata does not describe this object",
            obj_id=info.obj_id,
        )
    return tensors


def _shown(specs: Any) -> str:
    if specs is None:
        return "(unreadable)"
    return "[" + ", ".join(
        str(s) if isinstance(s, TensorSpec) else f"{str(s[1]).removeprefix('torch.')}{list(s[0])}" for s in specs
    ) + "]"


def _retrieve(fut: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


_actor_cache: dict[str, Any] = {}


def _current_actor() -> Any:
    """Return this process's ActorHandle, or None (driver, plain process, no Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    if actor_id is None:
        return None
    handle = _actor_cache.get(actor_id)
    if handle is None:
        handle = _actor_cache[actor_id] = ctx.current_actor
    return handle
