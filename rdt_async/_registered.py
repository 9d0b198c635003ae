"""Memory registered with a transport ahead of time: `register_memory` and its handle.

A transport that registers memory per object (NIXL) pays for it each time an object is
made of a storage nobody uses, and a consumer each time it fetches into a buffer. A
registration made here holds the storages until `close()`: objects made of the tensors
(or views of them) and fetches `into=` them reuse it, as with Ray's
`register_nixl_memory`. The transport keeps the refcount; this module checks the input,
runs the registration off the event loop, and keeps the handle honest (closed once).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from . import _io
from ._errors import translating
from .transports import _registry
from .transports._base import Transport


class MemoryRegistration:
    """Tensors' memory kept registered with a transport until `close()` (or the process ends).

    Objects made of these tensors or of views of them, and fetches `into=` them, reuse
    the registration. Use it as a context manager (`with` or `async with`) or call
    `close()` once. Closing while objects still use the memory leaves it registered
    until the last of them is freed; the tensors' storages live at least that long.
    """

    def __init__(self, transport: Transport[Any], token: Any, tensors: Sequence[torch.Tensor]) -> None:
        self.transport = transport.name
        self.tensors = len(tensors)
        storages = {(s.data_ptr(), s.nbytes()) for s in (t.untyped_storage() for t in tensors)}
        self.nbytes = sum(n for _, n in storages)  # each storage is registered whole, once
        self._impl, self._token = transport, token
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Deregister (quick, never blocks); memory that objects still use stays until they go.

        Raises: RuntimeError if this registration was closed already.
        """
        if not self._close_once():
            raise RuntimeError(
                f"this registration of {self.tensors} tensor(s) with {self.transport!r} is closed already: "
                "close each registration once (a `with` or `async with` block closes it at its end)"
            )

    def _close_once(self) -> bool:
        """Deregister unless closed already; return whether this call closed it."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._impl.deregister_memory(self._token)
        return True

    def __enter__(self) -> MemoryRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_once()

    async def __aenter__(self) -> MemoryRegistration:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close_once()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "registered"
        return f"<MemoryRegistration {self.transport}: {self.tensors} tensor(s), {self.nbytes} bytes, {state}>"


async def register_memory(tensors: Any, /, *, transport: str = "nixl") -> MemoryRegistration:
    """Register the memory of `tensors` with `transport` until the handle is closed.

    `tensors` is a tensor, or a list, tuple, dict (its values) or other iterable of them
    (`model.parameters()`). Each storage is registered whole, once, off the event loop.
    Runs on: producer (objects of these tensors skip registration) or consumer (fetches
    `into=` them skip it).
    Raises: TypeError for a non-tensor; ValueError for a transport that registers no
    memory, no tensors, or a tensor that is not dense, contiguous and on the transport's
    devices; TransportUnavailableError if the transport is not installed here.
    """
    impl, flat = _checked(tensors, transport, "register_memory")
    with translating(f"registering {len(flat)} tensor(s) with {transport!r}", transport=type(impl)):
        token = await _io.to_thread_finished(impl.register_memory, flat, undo=impl.deregister_memory)
    return MemoryRegistration(impl, token, flat)


def register_memory_sync(tensors: Any, /, *, transport: str = "nixl") -> MemoryRegistration:
    """Blocking twin of `register_memory`, for sync actors (`__init__`) and the driver.

    Raises: as `register_memory`; RuntimeError on a thread that runs an event loop (use
    `await rdt.register_memory(...)` there).
    """
    impl, flat = _checked(tensors, transport, "register_memory_sync")
    if _io.running_loop() is not None:
        raise RuntimeError(
            "rdt.register_memory_sync() would block the event loop running in this thread; "
            "use `await rdt.register_memory(...)` here instead"
        )
    with translating(f"registering {len(flat)} tensor(s) with {transport!r}", transport=type(impl)):
        token = impl.register_memory(flat)
    return MemoryRegistration(impl, token, flat)


def stats() -> dict[str, dict[str, int]]:
    """Return, per transport created in this process that registers memory, what it holds."""
    return {t.name: t.memory_stats() for t in _registry.created() if t.registers_memory}


def _checked(tensors: Any, transport: str, verb: str) -> tuple[Transport[Any], list[torch.Tensor]]:
    """Return the transport and the tensors to register (empty ones left out), or raise naming the fix."""
    flat = _tensors(tensors, verb)
    if transport == _registry.AUTO:
        raise ValueError(
            f"rdt.{verb}(transport='auto'): `auto` picks a transport per object; name the one "
            "whose memory to register, e.g. transport='nixl'"
        )
    _registry.check_name(transport)
    cls = _registry.transport_class(transport)
    if not cls.registers_memory:
        raise ValueError(
            f"rdt.{verb}(transport={transport!r}): transport {transport!r} registers no memory ahead of "
            "time (it has nothing per object that a registration would save); register with a transport "
            "that does, e.g. transport='nixl'"
        )
    impl = _registry.transport(transport)
    for i, t in enumerate(flat):
        if t.layout != torch.strided:
            raise ValueError(f"rdt.{verb}(): tensor {i} is {t.layout}, not dense; register t.to_dense()")
        if t.device.type not in impl.devices:
            raise ValueError(
                f"rdt.{verb}(): tensor {i} is on {t.device}; transport {transport!r} registers memory "
                f"on {', '.join(impl.devices)}: move it there first (t.to(...)) and register that tensor"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"rdt.{verb}(): tensor {i} is not contiguous (shape {list(t.shape)}, stride {list(t.stride())}): "
                "an object made of it would be a contiguous copy, which the registration would not cover; "
                "register the contiguous tensor it is a view of (its whole storage is registered)"
            )
    flat = [t for t in flat if t.numel() > 0]
    if not flat:
        raise ValueError(f"rdt.{verb}(): no tensor with memory to register (all are empty)")
    return impl, flat


def _tensors(value: Any, verb: str) -> list[torch.Tensor]:
    """The tensors of `value`: a tensor, a mapping's values, or an iterable's items."""
    if isinstance(value, torch.Tensor):
        items: list[Any] = [value]
    elif isinstance(value, Mapping):
        items = list(value.values())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = list(value)
    else:
        raise TypeError(
            f"rdt.{verb}() takes a tensor, or a list, tuple, dict or iterable of tensors, not {type(value).__name__}"
        )
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rdt.{verb}(): item {i} is not a tensor but {type(t).__name__} {t!r:.60}")
    if not items:
        raise ValueError(f"rdt.{verb}() got no tensors: pass the tensors whose memory to register")
    return items
