"""Core benchmarks: shm and object_store fetches against Ray's object store and memcpy.

Every figure is a median over `repeat` runs; each baseline runs in the same process
tree, in the same run, on the same sizes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._loop import LoopStall

ZERO_COPY_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


@rdt.remote
class Producer:
    """Makes fresh tensors on request, as an RDT producer and as a plain Ray one."""

    @rdt.method
    def rdt_auto(self, nbytes: int) -> torch.Tensor:
        return _tensor(nbytes)

    @rdt.method(tensor_transport="object_store")
    def rdt_object_store(self, nbytes: int) -> torch.Tensor:
        return _tensor(nbytes)

    def plain(self, nbytes: int) -> torch.Tensor:
        return _tensor(nbytes)

    def ready(self) -> bool:
        return True


@rdt.remote
class Consumer:
    """Times fetches from inside an async actor, and watches its own loop."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    async def fetch(self, refs: list[Any], mode: str) -> dict[str, float]:
        ref = refs[0]
        into = None
        if mode == "into":
            obj = await ref
            n = obj.specs[0].shape[0]
            into = self.buffers.get(n)
            if into is None:
                into = self.buffers[n] = torch.empty(n, dtype=torch.uint8)
                into.fill_(1)  # fault the pages in: warm
        lag = LoopStall()
        t0 = time.perf_counter()
        if mode == "ray":
            value = await ref
        else:
            value = await rdt.fetch(ref, into=into)
        fetched = time.perf_counter() - t0
        await asyncio.sleep(0)
        await asyncio.to_thread(_touch, value)  # read every byte once
        total = time.perf_counter() - t0
        return {"fetch": fetched, "fetch_read": total, "max_lag": lag.stop()}

    async def take(self, value: Any) -> int:
        return int(value.numel())

    def record_fetch_us(self, n: int = 20_000) -> dict[str, float]:
        """Microseconds one fetch's metrics cost: on the caller's thread, and on the I/O loop."""
        from rdt_async import _metrics

        t0 = time.perf_counter()
        for _ in range(n):
            _metrics.fetched("shm", 4096, 0.001)
        t1 = time.perf_counter()
        for _ in range(n):
            _metrics._fetched("shm", 4096, 0.001)
        return {"caller_us": (t1 - t0) / n * 1e6, "io_loop_us": (time.perf_counter() - t1) / n * 1e6}

    async def ping(self) -> float:
        return time.perf_counter()

    async def lag_during_arg(self, value: Any) -> int:
        return int(value.numel())

    async def start_probe(self) -> None:
        self.probe = LoopStall()

    async def stop_probe(self) -> float:
        return self.probe.stop()


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), 7, dtype=torch.uint8)


def _touch(value: Any) -> int:
    return int(value[:: 4096].sum()) if value.numel() else 0


def memcpy_gib_s(nbytes: int, repeat: int) -> float:
    """Single-thread warm copy bandwidth, the yardstick for `into=`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 2**30
    finally:
        torch.set_num_threads(threads)


def fetch_rows(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """Actor -> async actor fetch latency and bandwidth, ours and Ray's, cold and warm."""
    prod, cons = Producer.remote(), Consumer.remote()
    zprod = Producer.options(runtime_env=ZERO_COPY_ENV).remote()
    zcons = Consumer.options(runtime_env=ZERO_COPY_ENV).remote()
    ray.get([a.ready.remote() for a in (prod, zprod)] + [cons.ping.remote(), zcons.ping.remote()])
    cases = [
        ("rdt auto (shm)", prod, "rdt_auto", cons, "rdt"),
        ("rdt auto, into=", prod, "rdt_auto", cons, "into"),
        ("rdt object_store", prod, "rdt_object_store", cons, "rdt"),
        ("ray object store", prod, "plain", cons, "ray"),
        ("ray object store, zero-copy torch", zprod, "plain", zcons, "ray"),
    ]
    rows = []
    for size in sizes:
        for name, producer, method, consumer, mode in cases:
            samples = []
            for i in range(repeat + 1):  # the first run warms the actors' buffers and code
                ref = getattr(producer, method).remote(size)
                ray.wait([ref])
                samples.append((i, ray.get(consumer.fetch.remote([ref], mode))))
                del ref
            warm = [s for i, s in samples if i > 0]
            med = {k: statistics.median(s[k] for s in warm) for k in warm[0]}
            rows.append(
                {
                    "bench": "fetch",
                    "case": name,
                    "size": size,
                    "cold_fetch_s": samples[0][1]["fetch"],
                    "fetch_s": med["fetch"],
                    "fetch_read_s": med["fetch_read"],
                    "gib_s": size / med["fetch_read"] / 2**30,
                    "max_loop_lag_ms": max(s["max_lag"] for s in warm) * 1000,
                }
            )
    for a in (prod, zprod, cons, zcons):
        ray.kill(a)
    return rows


def pass_rows(size: int, repeat: int) -> list[dict[str, Any]]:
    """Driver-submitted actor -> actor pass of one object, end to end (4 KB: overheads)."""
    prod, cons = Producer.remote(), Consumer.remote()
    ray.get([prod.ready.remote(), cons.ping.remote()])
    rows = [
        {"bench": "pass", "case": name, "size": size, "seconds": _pass_s(prod, cons, method, size, repeat)}
        for name, method in (("rdt auto", "rdt_auto"), ("ray object store", "plain"))
    ]
    ray.kill(prod)
    ray.kill(cons)
    return rows


def _pass_s(prod: Any, cons: Any, method: str, size: int, repeat: int) -> float:
    """Median seconds of a pass: `prod.method(size)` handed to `cons`, which touches its bytes."""
    ray.get(cons.take.remote(getattr(prod, method).remote(size)))
    times = []
    for _ in range(max(repeat * 10, 20)):
        t0 = time.perf_counter()
        ray.get(cons.take.remote(getattr(prod, method).remote(size)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def metrics_rows(repeat: int, size: int = 4 << 10) -> list[dict[str, Any]]:
    """What Ray metrics cost: a 4 KiB pass with them on and off, and one fetch's recording alone."""
    rows = []
    for case, env in (("rdt auto, metrics on", {}), ("rdt auto, RDT_METRICS=0", {"RDT_METRICS": "0"})):
        opts = {"runtime_env": {"env_vars": env}} if env else {}
        prod, cons = Producer.options(**opts).remote(), Consumer.options(**opts).remote()
        ray.get([prod.ready.remote(), cons.ping.remote()])
        row = {"bench": "metrics", "case": case, "size": size, "seconds": _pass_s(prod, cons, "rdt_auto", size, repeat)}
        if not env:
            row.update({f"record_fetch_{k}": v for k, v in ray.get(cons.record_fetch_us.remote()).items()})
        rows.append(row)
        ray.kill(prod)
        ray.kill(cons)
    return rows


def responsiveness_rows(size: int) -> list[dict[str, Any]]:
    """How long an async actor's other calls wait while `size` bytes arrive as an argument."""
    prod, cons = Producer.remote(), Consumer.remote()
    ray.get([prod.ready.remote(), cons.ping.remote()])
    rows = []
    for name, method in (("rdt auto (shm)", "rdt_auto"), ("rdt object_store", "rdt_object_store")):
        ref = getattr(prod, method).remote(size)
        ray.wait([ref])
        ray.get(cons.start_probe.remote())
        t0 = time.perf_counter()
        pending = cons.lag_during_arg.remote(ref)
        worst = 0.0
        while not ray.wait([pending], timeout=0)[0]:
            s = time.perf_counter()
            ray.get(cons.ping.remote())
            worst = max(worst, time.perf_counter() - s)
        transfer = time.perf_counter() - t0
        lag = ray.get(cons.stop_probe.remote())
        rows.append(
            {
                "bench": "responsiveness",
                "case": name,
                "size": size,
                "transfer_s": transfer,
                "worst_ping_ms": worst * 1000,
                "max_loop_lag_ms": lag * 1000,
            }
        )
        del ref
    ray.kill(prod)
    ray.kill(cons)
    return rows
