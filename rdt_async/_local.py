"""This host's plumbing, for the core and transports alike: whether a process of this node
lives, and tensors laid out in, viewed over and copied into host memory (split across
threads where large)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import _io
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


def in_buffers(tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` are `buffers` (a transfer landed in them), not tensors of other
    memory (a memfd's views, a transport's own) that are still to be copied there."""
    return len(tensors) == len(buffers) and all(
        t.data_ptr() == b.data_ptr() or b.numel() == 0 for t, b in zip(tensors, buffers)
    )


def copy_into(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy each source into its buffer (a blocking call: run it in the pool)."""
    for dst, src in zip(buffers, sources):
        dst.copy_(src)
    return list(buffers)


# Copies into shared memory (shm's segment, a publisher's slot) from this size (all the
# tensors together) are split in byte ranges across _io.COPY_CORES threads: Ray starts workers with OMP_NUM_THREADS=1,
# and one thread's `copy_` into a shared mapping reaches 2/3 of what two do (256 MiB: 51
# ms, 34 ms on two free cores). Below it the hand-off costs more than it saves (8 MiB:
# 0.9 ms on one thread, 1.5 ms split; 16 MiB: about even).
SPLIT_WRITE_BYTES = 16 << 20
# ... and only where the tensors average this many bytes: threads that each copy thousands
# of small tensors hand the GIL to one another at every one (10,000 of 4 KiB: 164 ms split,
# 19 ms on one thread).
SPLIT_MEAN_BYTES = 256 << 10
_SPLIT_ALIGN = 4096  # where a contiguous tensor's bytes are cut between threads


def copy_to(mm: Any, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copy `tensors` into the mapping `mm` (any writable buffer) at byte `offsets`: on
    this thread below SPLIT_WRITE_BYTES in all (or with one core, or small tensors: see
    SPLIT_MEAN_BYTES), else split (`_copy_split`). Blocking."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total < SPLIT_WRITE_BYTES or _io.COPY_CORES == 1 or total < SPLIT_MEAN_BYTES * len(tensors):
        _copy_each(mm, tensors, offsets)
        return
    _copy_split(mm, tensors, offsets)


def _copy_each(mm: Any, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """`copy_to` on this thread: a contiguous tensor's bytes by libc's memmove (no view of
    `mm` made: ~1 us a tensor, against ~15 for a view and `copy_`), another by `copy_`.

    Raises: ValueError for a tensor that would reach past the end of `mm` (checked before
    anything is written; a view would refuse it, a raw copy would not).
    """
    with memoryview(mm) as whole:
        size = whole.nbytes
    if any(off < 0 or off + t.numel() * t.element_size() > size for t, off in zip(tensors, offsets)):
        raise ValueError(f"copy_to: a tensor reaches past the {size} bytes it is copied into")
    anchor = None  # mm's first byte, exported while raw copies run (mm cannot close meanwhile)
    try:
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if not n:
                continue
            if t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                if anchor is None:
                    anchor = ctypes.c_char.from_buffer(mm)
                ctypes.memmove(ctypes.addressof(anchor) + off, t.data_ptr(), n)
            else:  # (a lazy conjugate or negation too: `copy_` resolves it, raw bytes would not)
                dst = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=off)
                dst.view(t.shape).copy_(t)
                del dst
    finally:
        del anchor


def _copy_split(mm: Any, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """`copy_to` in _io.COPY_CORES parts of about equal bytes at once: this thread copies
    one, the SHM_WRITE pool the others.

    A part the pool has not started when this thread is done with its own, this thread
    copies too: a busy pool never makes a copy slower than one thread's. Blocking.
    """
    mine, *others = _parts(mm, tensors, offsets, _io.COPY_CORES)
    futures = [_io.pool(_io.SHM_WRITE).submit(_copy_part, p) for p in others]
    try:
        _copy_part(mine)
        for f, p in zip(futures, others):
            if f.cancel():  # not started: the pool is busy with other copies
                _copy_part(p)
    finally:  # those started write into `mm`, which the caller may drop next
        # (one cancelled counts as done for `wait` only once the pool dequeues it)
        concurrent.futures.wait([f for f in futures if not f.cancelled()])
    for f in futures:
        if not f.cancelled():
            f.result()


def _parts(
    mm: Any, tensors: Sequence[torch.Tensor], offsets: Sequence[int], n: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Cut the copies of `tensors` into `mm` into at most `n` lists of (destination, source)
    of about equal bytes: a contiguous tensor as bytes anywhere (at _SPLIT_ALIGN), another
    along its first dimension."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    target = max(1, -(-total // n))
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    filled = 0
    for t, off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            continue
        src = t.detach()
        if src.is_contiguous() and not (src.is_conj() or src.is_neg()):
            dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
            src, unit = src.view(-1).view(torch.uint8), 1
        else:  # (a lazy conjugate or negation too: `copy_` resolves it, a byte view would not)
            src = src.reshape(1) if src.dim() == 0 else src
            dst = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=off).view(src.shape)
            unit = nbytes // src.shape[0]
        rows, at = src.shape[0], 0
        while at < rows:
            take = rows - at if len(parts) == n else min(rows - at, max(1, -(-(target - filled) // unit)))
            if unit == 1 and at + take < rows:  # cut at a multiple of _SPLIT_ALIGN bytes into the tensor
                take = min(rows - at, -(-(at + take) // _SPLIT_ALIGN) * _SPLIT_ALIGN - at)
            parts[-1].append((dst[at : at + take], src[at : at + take]))
            at += take
            filled += take * unit
            if filled >= target and len(parts) < n:
                parts.append([])
                filled = 0
    return [p for p in parts if p] or [[]]


def _copy_part(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (destination, source) of `part`: byte ranges by libc's memmove, the rest by `copy_`.

    memmove (the GIL released, as by `copy_`) picks its stores by size: past libc's
    non-temporal threshold (glibc: about 3/4 of the last-level cache) it writes around
    the cache, sparing the read of each destination line that `copy_`'s stores make
    (256 MiB on one thread here: 1.3-1.7x faster than `copy_`; the same below it).
    """
    try:
        for i in range(len(part)):
            dst, src = part[i]
            if dst.dtype == src.dtype == torch.uint8 and dst.dim() == src.dim() == 1 and src.is_contiguous():
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())  # (`_parts`: same length, no overlap)
            else:
                dst.copy_(src)
    finally:
        part.clear()  # no view of the mapping outlives the copy, in a traceback either
