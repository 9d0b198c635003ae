"""Checks that need neither Ray nor actors: the GPU machine runs the contract suite with these."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch


def checksum(t: torch.Tensor) -> float:
    return float(t.double().sum())


def cpu_seconds() -> float:
    """CPU time (user + system) of this process so far, from /proc."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(seconds: float) -> float:
    """CPU this process burns over `seconds` while the calling thread sleeps."""
    t0 = cpu_seconds()
    time.sleep(seconds)
    return cpu_seconds() - t0


class LagProbe:
    """Measures how late an event loop wakes a 5 ms sleeper: a blocked loop shows here."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.max_lag = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> float:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.max_lag

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            self.max_lag = max(self.max_lag, time.perf_counter() - t0 - 0.005)


async def cancel_after(awaitable: Any, seconds: float) -> str:
    """Start `awaitable`, cancel it after `seconds`: "done" if it finished first, else "cancelled"."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.sleep(seconds)
    task.cancel()
    try:
        await task
        return "done"
    except asyncio.CancelledError:
        return "cancelled"
