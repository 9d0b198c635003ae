"""Consumer buffers registered once per process and lent out in chunks.

Reads of CPU objects up to BOUNCE_BYTES land in a bounce chunk and are copied out (a
registration costs more than copying 64 KiB). Liveness slots are read into landing
slots. Both are registered with the agent when it is made, so a fetch that finds a
free chunk registers nothing.
"""

from __future__ import annotations

import threading

import torch

from ._agent import Agent

BOUNCE_BYTES, BOUNCE_CHUNKS = 64 << 10, 16
LANDING_SLOTS = 1024  # liveness reads in flight at once without a registration of their own


class Chunks:
    """One registered buffer of `n` chunks of `numel` elements; `_lock` guards the free list."""

    def __init__(self, agent: Agent, n: int, numel: int, dtype: torch.dtype) -> None:
        self.buffer = torch.zeros(n * numel, dtype=dtype)
        agent.locked(agent.nixl.register_memory, self.buffer)
        self._numel = numel
        self._lock = threading.Lock()
        self._free = list(range(n - 1, -1, -1))

    @property
    def free(self) -> int:
        """Return how many chunks are not lent out now."""
        with self._lock:
            return len(self._free)

    def take(self) -> int:
        """Return a free chunk's index, or -1 if all are lent out."""
        with self._lock:
            return self._free.pop() if self._free else -1

    def give(self, i: int) -> None:
        """Take back chunk `i` (-1: nothing to give)."""
        if i >= 0:
            with self._lock:
                self._free.append(i)

    def view(self, i: int) -> torch.Tensor:
        return self.buffer[i * self._numel : (i + 1) * self._numel]


class Scratch:
    """The bounce chunks and the landing slots of this process's agent."""

    def __init__(self, agent: Agent) -> None:
        self.landing = Chunks(agent, LANDING_SLOTS, 2, torch.int64)  # a liveness slot: token, digest
        self.bounce = Chunks(agent, BOUNCE_CHUNKS, BOUNCE_BYTES, torch.uint8)
