"""The buffers a member's collectives reduce into, per group, reused once nothing else
holds them (these VMs fault fresh memory in at ~0.3 GiB/s: reuse beats allocation).
Runs on: member.
"""

from __future__ import annotations

import gc
import threading

import torch

BUFFERS_PER_SHAPE = 2  # result buffers a member keeps per (dtype, size) for reuse
COLLECT_BYTES = 1 << 20  # from this size, a busy buffer is worth a young-generation GC to free


class Buffers:
    """Buffers of one group's collectives in this member, reused once nothing else holds them.

    A buffer is handed out as an alias (a view), so that it counts as held while that
    alias, or any view of it (the tensors of a result object), is alive. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[torch.dtype, int, str], list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """Return a flat buffer of `numel` elements that nothing else holds now."""
        key = (dtype, numel, str(device))
        with self._lock:
            kept = self._kept.setdefault(key, [])
            for attempt in range(2):
                for b in kept:
                    if _unshared(b):
                        return b.view(-1)
                if not kept or attempt or numel * dtype.itemsize < COLLECT_BYTES:
                    break
                # Flattening a value makes short-lived reference cycles (recursive closures)
                # that hold its tensors until the cyclic GC runs: collect the young ones
                # (well under a millisecond) rather than fault in fresh memory.
                gc.collect(1)
            b = torch.empty(numel, dtype=dtype, device=device)
            if len(kept) < BUFFERS_PER_SHAPE:
                kept.append(b)
            return b.view(-1)


def _unshared(t: torch.Tensor) -> bool:
    """Say whether nothing but `t` itself holds its storage (False where torch cannot tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(t.untyped_storage()._cdata) <= 2)  # t, and the storage object asked


_by_group: dict[str, Buffers] = {}
_lock = threading.Lock()


def of(group: str) -> Buffers:
    """Return the buffers of `group` in this member, made on first use."""
    with _lock:
        return _by_group.setdefault(group, Buffers())


def drop(group: str) -> None:
    """Let the buffers of `group` go (the member left it)."""
    with _lock:
        _by_group.pop(group, None)
