"""Actors and checks shared by the tests."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import torch
from probes import LagProbe, checksum, cpu_seconds, idle_cpu  # noqa: F401  (the tests import them from here too)

import rdt_async as rdt


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
        return os.getpid()

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


class Probed:
    """A base for async test actors with a probe on their loop: its worst stall, and what held it."""

    def __init__(self) -> None:
        self.probe = LagProbe()

    async def start_probe(self) -> None:
        self.probe.start()

    async def stop_probe(self) -> tuple[float, str]:
        return await self.probe.stop(), self.probe.report()


class FetchesWithTimeout:
    """For async consumers: a fetch under a caller's deadline, and how it ended."""

    async def fetch_with_timeout(self, refs, seconds: float):
        try:
            async with asyncio.timeout(seconds):
                await rdt.fetch(refs[0])
        except TimeoutError:
            return "timeout"
        return "done"


@rdt.remote
class AsyncConsumer(Probed, FetchesWithTimeout):
    """An async actor that consumes RDT objects and measures its loop's lag."""

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

    async def ping(self) -> float:
        return time.perf_counter()

    async def stats(self):
        return rdt.store_stats()

    def get_in_loop(self, refs):
        return rdt.get(refs[0])


class Tied(torch.nn.Module):
    """A model whose head shares its embedding's weight (tied embeddings, as small LLMs have)."""

    def __init__(self, tie: bool = True, n: int = 1 << 12) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(n, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, n, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 1000 * i)


def manager_base(backend: str, *, one_sided: bool = True, can_abort: bool = False) -> type:
    """A base for the tests' Ray `TensorTransportManager`s: the methods every such manager
    has alike (its backend's name, whether it is one-sided and aborts, present on every
    actor); subclasses say what they move."""
    from ray.experimental.rdt.tensor_transport_manager import TensorTransportManager

    class Manager(TensorTransportManager):
        def tensor_transport_backend(self):
            return backend

        @staticmethod
        def is_one_sided():
            return one_sided

        @staticmethod
        def can_abort_transport():
            return can_abort

        def actor_has_tensor_transport(self, actor):
            return True

    return Manager


class Said(logging.Handler):
    """What rdt_async logged at WARNING and above, as messages (`lines`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
