"""`inline`: small objects travel inside the RDTObject itself, as Ray inlines small values.

`auto` picks it for CPU objects of at most `AUTO_MAX_BYTES`: a fetch then needs no
segment, no round trip and no hop to the I/O loop, on any node. The bytes are a snapshot
taken at return, so the producer keeps nothing for such an object: no store entry, no
anchor (Ray's bookkeeping of a ref inside the returned value was most of a small pass's
cost), and `wait_tensor_freed` does not wait for it. The producer's own fetches still
return its tensors while they live (see `_object._Recent`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .._errors import TransferError, TransportUnavailableError
from ._base import Channel, TensorSpec, TransferInfo, Transport

AUTO_MAX_BYTES = 64 << 10  # what auto inlines
MAX_BYTES = 1 << 20  # what an explicit tensor_transport="inline" accepts


class InlineTransport(Transport[tuple[bytes, ...]]):
    """Bytes carried in the object's metadata (CPU tensors, at most 1 MiB)."""

    name = "inline"
    devices = ("cpu",)
    one_sided = True
    carries_bytes = True
    auto_prepares = True  # alone, for objects of at most AUTO_MAX_BYTES
    auto_max_bytes = AUTO_MAX_BYTES

    def check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        super().check_tensors(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > MAX_BYTES:
            raise TransportUnavailableError(
                f"transport 'inline' carries at most {MAX_BYTES} bytes in the ref, not {nbytes}; "
                "use tensor_transport='auto' or 'shm'"
            )

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> tuple[bytes, ...]:
        return tuple(encode(t) for t in tensors)

    def receive_nowait(
        self, info: TransferInfo[tuple[bytes, ...]], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        check(info.obj_id, info.meta, info.specs)
        out = decode(info.meta, [(s.shape, s.dtype) for s in info.specs])
        return out if buffers is None else [b.copy_(t) for b, t in zip(buffers, out)]

    async def receive(
        self, info: TransferInfo[tuple[bytes, ...]], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        return self.receive_nowait(info, buffers)


def check(obj_id: str, meta: object, specs: Sequence[TensorSpec]) -> None:
    """Raise TransferError unless `meta` holds one bytes object of each tensor's size.

    Runs on: consumer, before the bytes are read.
    """
    why = None
    if type(meta) is not tuple or len(meta) != len(specs):
        n = len(meta) if isinstance(meta, (tuple, list)) else type(meta).__name__
        why = f"it carries {n} tensor(s)' bytes for {len(specs)} tensor(s)"
    else:
        for i, (data, spec) in enumerate(zip(meta, specs)):
            if type(data) is not bytes or len(data) != spec.nbytes:
                size = f"{len(data)} bytes" if type(data) is bytes else f"a {type(data).__name__}"
                why = f"tensor {i} ({spec}) is {spec.nbytes} bytes, but the ref carries {size}"
                break
    if why is not None:
        raise TransferError(
            f"inline fetch of {obj_id}: the ref's inline bytes do not match its tensors ({why}); "
            "nothing was read. Pass refs as rdt_async hands them out, unaltered",
            obj_id=obj_id,
        )


def decode(meta: Sequence[bytes], specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors of an inline object, new and writable, from its bytes."""
    return [
        torch.frombuffer(bytearray(data), dtype=dtype).view(tuple(shape)) if data else torch.empty(tuple(shape), dtype=dtype)
        for data, (shape, dtype) in zip(meta, specs)
    ]


def encode(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor, for `decode` (one copy, read where the tensor lies)."""
    if not t.is_cpu or t.layout != torch.strided:
        raise TransferError(f"inline carries the bytes of dense CPU tensors, not a {t.layout} tensor on {t.device}")
    if t.numel() == 0:
        return b""
    if not t.is_contiguous():
        t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
