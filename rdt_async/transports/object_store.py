"""`object_store`: tensors through Ray's object store; works between any two processes.

Two-sided: the consumer asks the producer (over the channel the core hands in, which
is an actor call to the producer's `rdt` group) and the reply carries the bytes as
NumPy arrays, which Ray moves out of band and without pickling tensor data. The reply's
arrays are copies made while the store holds the object: Ray serializes a reply after
the call has returned and the hold has ended, when `wait_tensor_freed` may have let the
producer write the tensors again.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .. import _cuda, _io
from .._errors import TransferError
from ._base import Channel, Cost, TensorSpec, TransferInfo, Transport
from ._kit import local_device


class ObjectStoreTransport(Transport[None]):
    """Ray's object store (any device, any node; slowest, always there)."""

    name = "object_store"
    devices = ("cpu", "cuda")
    one_sided = False
    # Never prepared by auto (every object has it: the fallback), but costed like the rest.
    auto_costs: ClassVar[Mapping[str, Cost]] = {
        "cpu/node": Cost(0.0055, 0.81),
        "cpu/hosts": Cost(0.0064, 0.30),
        "gpu/node": Cost(0.010, 1.0),  # not measured (no Ray beside a GPU): by design, last
        "gpu/hosts": Cost(0.012, 0.5),
    }

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: None, request: Any
    ) -> list[np.ndarray]:
        return await _io.to_thread(functools.partial(to_wire, owned=True), tensors)

    async def receive(
        self, info: TransferInfo[None], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        arrays = await channel.request_send(None)
        check_wire(info.obj_id, arrays, info.specs)
        return await _io.to_thread_finished(_cuda.settled, from_wire, arrays, info.specs, buffers)


def to_wire(tensors: Sequence[torch.Tensor], *, owned: bool = False) -> list[np.ndarray]:
    """Return each tensor's bytes as a flat uint8 array (bfloat16 and bool included);
    `owned`: never a view of the tensor's memory (a copy where it would be one)."""
    out = []
    for t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if not flat.numel():
            out.append(np.empty(0, np.uint8))
            continue
        arr = flat.view(torch.uint8).numpy()
        out.append(arr.copy() if owned and flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else arr)
    return out


def check_wire(obj_id: str, arrays: object, specs: Sequence[TensorSpec]) -> None:
    """Raise TransferError unless `arrays` is what `to_wire` makes of tensors of `specs`:
    a list of one flat uint8 array per tensor, each of its tensor's size.

    The wire carries bytes only: a shape or dtype that keeps the size is not seen here.
    Runs on: consumer, before anything is copied.
    """
    why = None
    if type(arrays) is not list or len(arrays) != len(specs):
        n = len(arrays) if isinstance(arrays, (list, tuple)) else type(arrays).__name__
        why = f"{n} array(s) for {len(specs)} tensor(s)"
    else:
        for i, (arr, spec) in enumerate(zip(arrays, specs)):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
                kind = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
                why = f"tensor {i} came as {kind}, not flat uint8 bytes"
                break
            if arr.size != spec.nbytes:
                why = f"tensor {i} ({spec}) is {spec.nbytes} bytes, but {arr.size} came"
                break
    if why is not None:
        raise TransferError(
            f"object_store fetch of {obj_id}: what came does not match the ref's tensors ({why}); "
            "the ref was altered, or its object-store reply is not this object's",
            obj_id=obj_id,
        )


def from_wire(
    arrays: Sequence[np.ndarray], specs: Sequence[TensorSpec], buffers: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """Rebuild tensors from wire arrays, copying out of Ray's read-only buffers."""
    out = []
    for i, (arr, spec) in enumerate(zip(arrays, specs)):
        if arr.size == 0:
            src = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            with warnings.catch_warnings():  # read-only: we copy out at once
                warnings.simplefilter("ignore", UserWarning)
                if arr.ctypes.data % 16 == 0:
                    src = torch.frombuffer(arr, dtype=spec.dtype).view(spec.shape)
                else:  # Ray hands small arrays back unaligned: read as bytes (complex128 crashed)
                    src = torch.empty(spec.shape, dtype=spec.dtype)
                    src.view(-1).view(torch.uint8).copy_(torch.frombuffer(arr, dtype=torch.uint8))
        if buffers is not None:
            out.append(buffers[i].copy_(src))
        elif (device := local_device(spec.device)).type == "cpu":
            out.append(src.clone())
        else:
            out.append(src.to(device))  # where it was produced, as the other transports do
    return out
