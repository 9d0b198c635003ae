"""Actors and checks shared by the tests."""

from __future__ import annotations

import asyncio
import os
import time

import torch

import rdt_async as rdt


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


@rdt.remote
class SyncProducer:
    """A plain (sync) actor that produces tensors."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    @rdt.method
    def make(self, n: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(n, generator=g).to(dtype), "step": seed, "meta": ["x", (1, 2)]}

    @rdt.method
    def value(self, v):
        return v

    @rdt.method(tensor_transport="object_store")
    def value_os(self, v):
        return v

    @rdt.method(tensor_transport="shm")
    def value_shm(self, v):
        return v

    def put(self, v, transport: str = "auto"):
        return [rdt.put(v, tensor_transport=transport)]

    def stats(self):
        return rdt.store_stats()

    def pid(self):
        import os

        return os.getpid()

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


@rdt.remote
class AsyncConsumer:
    """An async actor that consumes RDT objects and measures its loop's lag."""

    def __init__(self) -> None:
        self.probe = LagProbe()

    async def checksums(self, *values, **kw):
        return [checksum(v) for v in values] + [checksum(v) for v in kw.values()]

    async def take(self, value):
        return value

    async def fetch(self, refs, **kw):
        return await rdt.fetch(refs[0], **kw)

    async def fetch_all(self, refs):
        return await rdt.fetch_all(refs)

    async def as_completed(self, refs):
        return [i async for i, _ in rdt.as_completed(refs)]

    async def fetch_with_timeout(self, refs, seconds: float):
        try:
            async with asyncio.timeout(seconds):
                await rdt.fetch(refs[0])
        except TimeoutError:
            return "timeout"
        return "done"

    async def start_probe(self):
        self.probe.start()

    async def stop_probe(self) -> float:
        return await self.probe.stop()

    async def ping(self) -> float:
        return time.perf_counter()

    async def stats(self):
        return rdt.store_stats()

    def get_in_loop(self, refs):
        return rdt.get(refs[0])
