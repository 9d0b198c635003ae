"""This host's plumbing, for the core and transports alike: whether a process of this node
lives, and tensors laid out in, viewed over and copied into host memory."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .transports._base import TensorSpec


def pid_alive(pid: int) -> bool:
    """Say whether process `pid` of this node may be alive (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process stays a zombie until its parent reaps it: dead all the same
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
        return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal's answer stands


def aligned_layout(sizes: Iterable[int], align: int = 64) -> tuple[list[int], int]:
    """Offsets of blocks of `sizes` bytes laid end to end, each starting at a multiple of
    `align`, and the bytes they span in all."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    return offsets, end


def view_in(buffer: Any, spec: TensorSpec, offset: int) -> torch.Tensor:
    """A tensor of `spec` over `buffer` (an mmap) from byte `offset`, sharing its memory;
    a new empty one where it has no elements or there is no buffer."""
    numel = math.prod(spec.shape)
    if numel == 0 or buffer is None:
        return torch.empty(spec.shape, dtype=spec.dtype)
    return torch.frombuffer(buffer, dtype=spec.dtype, count=numel, offset=offset).view(spec.shape)


def copy_into(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy each source into its buffer (a blocking call: run it in the pool)."""
    for dst, src in zip(buffers, sources):
        dst.copy_(src)
    return list(buffers)
