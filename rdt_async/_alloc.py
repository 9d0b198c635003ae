"""Receive buffers for large CPU tensors, reused once their tensors are dropped.

A fresh `torch.empty` of 256 MiB costs about as much to touch as Gloo takes to fill
it: the kernel faults in 65,536 pages one by one (0.12 s here). Buffers from `empty`
are anonymous mappings; when the last tensor viewing one is dropped, the mapping goes
to a small cache for the next receive of its size class instead of being unmapped, so
a steady stream of receives touches warm pages. The cache holds at most `CACHE_BYTES`
and unmaps what has been idle for `IDLE_S` seconds (checked every `IDLE_S`).

A tensor from here has a storage of its own bytes, in memory torch did not allocate: it
cannot grow (`resize_()` to more elements, an `out=` of a larger result, raise).

Transparent huge pages are not asked for: with `defrag=madvise` the first touch of an
advised 256 MiB mapping stalled 0.2-0.6 s in compaction here, slower than faulting.

Runs on: consumer.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from . import _io
from .transports._segments import let_go_off_loop

MIN_BYTES = 1 << 20  # smaller receives use torch.empty: faults are cheap there
CLASS_BYTES = 2 << 20  # sizes round up to this, so near sizes share buffers
CACHE_BYTES = 1 << 30
IDLE_S = 5.0

_lock = threading.Lock()
_free: dict[int, list[tuple[float, mmap.mmap]]] = {}  # size class -> (freed at, mapping)
_cached = 0
_sweep_due = False


def empty(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """Return an uninitialized contiguous tensor; CPU ones come from the cache when one fits."""
    if device != "cpu" and torch.device(device).type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize  # (math's: numpy's prod costs microseconds a call)
    if nbytes < MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    size = -(-nbytes // CLASS_BYTES) * CLASS_BYTES
    _io.settle()  # buffers dropped just now are back in the cache
    mm = _take(size)
    if mm is None:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor's storage is `owner`, its own bytes only: the rest of the class holds an
    # earlier receive's (another object's, maybe), which `untyped_storage()`, `torch.save`
    # or a pickle of the tensor would carry along. The storage keeps `owner` alive.
    owner = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    _io.finalize(owner, _give_back, size, mm)
    return torch.from_numpy(owner).view(dtype).view(tuple(shape))


def cached_bytes() -> int:
    """Return the bytes the cache holds now."""
    _io.settle()
    return _cached


def _take(size: int) -> mmap.mmap | None:
    global _cached
    with _lock:
        free = _free.get(size)
        if not free:
            return None
        _, mm = free.pop()
        _cached -= size
        return mm


def _give_back(size: int, mm: mmap.mmap) -> None:
    """The last view of a buffer is gone: keep it for the next receive, or unmap it.
    (Through `_io.finalize`: never inside the finalizer, which may run under `_lock`.)"""
    global _cached, _sweep_due
    with _lock:
        keep = _cached + size <= CACHE_BYTES
        if keep:
            _free.setdefault(size, []).append((time.monotonic(), mm))
            _cached += size
            start_sweep, _sweep_due = not _sweep_due, True
    # A dropped mapping unmaps itself once the array's buffer export is released (it
    # still is while weakref callbacks run, so `close()` would fail here).
    if keep and start_sweep:
        try:
            _io.call_soon(_schedule_sweep)
        except RuntimeError:  # interpreter shutting down: nothing will reuse it
            pass


def _schedule_sweep() -> None:
    _io.io_loop().call_later(IDLE_S, _sweep)


def _sweep() -> None:
    """Unmap buffers idle for IDLE_S (in the pool: 10-90 ms per few hundred MiB, time the
    loop owes the transfers under way); run again while any are left (on the I/O loop)."""
    global _cached, _sweep_due
    stale: list[mmap.mmap] = []
    now = time.monotonic()
    with _lock:
        for size, free in list(_free.items()):
            old = [mm for at, mm in free if now - at >= IDLE_S]
            if old:
                free[:] = [(at, mm) for at, mm in free if now - at < IDLE_S]
                _cached -= size * len(old)
                stale += old
            if not free:
                del _free[size]
        _sweep_due = bool(_free)
    let_go_off_loop(_unmap, stale)
    if _sweep_due:
        _schedule_sweep()


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # (never: its array went before it was cached) it goes with its last reference
        pass


def _forked() -> None:
    """In a forked child: the cached buffers are copies of the parent's, the sweep it
    scheduled runs not here, and `_lock` may be held by a thread that is not here. Let go
    of the copies and start empty."""
    global _lock, _free, _cached, _sweep_due
    _lock = threading.Lock()
    stale = [mm for free in _free.values() for _, mm in free]
    _free, _cached, _sweep_due = {}, 0, False
    for mm in stale:
        _unmap(mm)


os.register_at_fork(after_in_child=_forked)
