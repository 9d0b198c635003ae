"""Test code that moves tensors, and transports themselves, with nothing but Python.

- `MockTransport`: a transport that needs no library and no shared memory; subclass it
  and override `handle` to make your fetches slow, fail or change (as httpx ships
  `MockTransport`). Register it and your actors use it like any other transport.
- `roundtrip(transport, tensors)`: drive a transport's whole lifecycle in this process,
  without Ray: the unit test of a transport you write.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .transports._base import (
    Channel,
    FetchRequest,
    TensorSpec,
    TransferInfo,
    Transport,
)
from .transports._kit import delivered, local_device
from .transports.inline import decode, encode

__all__ = ["LoopbackChannel", "MockMeta", "MockTransport", "roundtrip"]


@dataclass(frozen=True)
class MockMeta:
    """The bytes of each tensor, carried inside the object (a snapshot taken at return)."""

    data: tuple[bytes, ...]


class MockTransport(Transport[MockMeta]):
    """Tensors carried inside the ref itself; every fetch goes through `handle`.

    It works between any two processes (actors, the driver, plain processes) on any
    node, for CPU and CUDA tensors, with no package, device or group: the producer copies
    the bytes into the object's metadata at return. Meant for tests, not for speed: the
    bytes travel through Ray with every ref.

        class Flaky(MockTransport):
            async def handle(self, info, tensors):
                raise rdt.PeerDiedError("the producer went away", obj_id=info.obj_id)

        rdt.register_transport("flaky", ["cpu"], Flaky)

        @rdt.remote
        class Producer:
            @rdt.method(tensor_transport="flaky")
            def make(self): ...
    """

    devices = ("cpu", "cuda")
    one_sided = True

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> MockMeta:
        return MockMeta(tuple(encode(t.cpu()) for t in tensors))

    async def handle(self, info: TransferInfo[MockMeta], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a fetch returns, on the consumer's I/O loop: by default the tensors as
        produced (on the CPU). Override it to delay (`await asyncio.sleep`), raise an
        rdt_async error, count fetches or return other tensors."""
        return tensors

    async def receive(
        self, info: TransferInfo[MockMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        produced = decode(info.meta.data, [(s.shape, s.dtype) for s in info.specs])
        tensors = await self.handle(info, produced)
        return delivered(buffers, [t.to(local_device(s.device)) for t, s in zip(tensors, info.specs)])


class LoopbackChannel:
    """The line to a producer in this same process: `request_send` runs the transport's
    `send_multiple_tensors` (or `refuse`, once `gone` is set) on the object's tensors."""

    def __init__(self, transport: Transport[Any], obj_id: str, tensors: Sequence[torch.Tensor], meta: Any) -> None:
        self.transport, self.obj_id, self.tensors, self.meta = transport, obj_id, list(tensors), meta
        self.gone = False
        self.requests: list[Any] = []

    async def request_send(self, request: Any) -> Any:
        self.requests.append(request)
        if self.gone:
            await self.transport.refuse(self.obj_id, request)
            return None
        return await self.transport.send_multiple_tensors(self.obj_id, self.tensors, self.meta, request)


async def roundtrip(
    transport: Transport[Any],
    tensors: Sequence[torch.Tensor],
    *,
    buffers: list[torch.Tensor] | None = None,
    obj_id: str = "roundtrip-0",
) -> list[torch.Tensor]:
    """Move `tensors` through `transport` in this process and return what arrived.

    The same steps as between two actors, in order: `check_tensors`, `prepare`,
    `receive_nowait` (when it answers) or `receive` on rdt_async's I/O loop (through a
    `LoopbackChannel` to the same instance for two-sided transports), then `recycle`.
    Errors are the transport's own, untranslated. A transport that needs two processes
    (Gloo, NCCL, CUDA IPC) needs the contract suite instead (`tests/transports/`).
    """
    transport.check_tensors(tensors)
    meta = transport.prepare(obj_id, tensors)
    info = TransferInfo(obj_id, tuple(TensorSpec.of(t) for t in tensors), meta, producer_pid=os.getpid())
    try:
        out = transport.receive_nowait(info, buffers)
        if out is None:
            channel = LoopbackChannel(transport, obj_id, tensors, meta)
            out = await FetchRequest.start(transport, info, buffers=buffers, channel=channel).wait()
        return out
    finally:
        transport.recycle(obj_id, meta)
