"""Core benchmarks: shm and object_store fetches against Ray's object store and memcpy.

Every figure is a median over `repeat` runs; each baseline runs in the same process
tree, in the same run, on the same sizes, the cases in turns (`_turns.take_turns`).
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._loop import LoopStall
from ._turns import take_turns

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

    async def fetch(self, refs: list[Any], mode: str, nbytes: int) -> dict[str, float]:
        """Time one fetch of `refs[0]` (`nbytes` of uint8) and a read of every byte.

        Every mode's clock starts at the ref as it arrived (an ObjectRef) and takes in
        its resolution: `into=`'s buffer (warm, one per size) is had before the clock,
        by the size, not by resolving the ref first.
        """
        ref = refs[0]
        into = None
        if mode == "into":
            into = self.buffers.get(nbytes)
            if into is None:
                into = self.buffers[nbytes] = torch.empty(nbytes, dtype=torch.uint8)
                into.fill_(1)  # fault the pages in: warm
        lag = LoopStall()
        t0 = time.perf_counter()
        if mode == "ray":
            value = await ref
        else:
            value = await rdt.fetch(ref, into=into)
        fetched = time.perf_counter() - t0
        await asyncio.sleep(0)
        await asyncio.to_thread(read_all, value, FILL)  # read every byte once
        total = time.perf_counter() - t0
        lag_s = lag.stop()
        if into is not None:  # (untimed) the next pass's read then fails unless that fetch wrote every byte
            await asyncio.to_thread(into.fill_, 1)
        return {"fetch": fetched, "fetch_read": total, "max_lag": lag_s}

    async def take(self, value: Any) -> int:
        """Read every byte of `value` (a pass's consumer); its count."""
        read_all(value, FILL)
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


FILL = 7  # every byte of every tensor the producer makes


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), FILL, dtype=torch.uint8)


def read_all(value: torch.Tensor, fill: int) -> int:
    """Read every byte of `value` (a uint8 tensor, each byte `fill`) once: their sum.

    The bytes are summed 8 at a time, as int64 words (wrapping, as their expected sum is
    reckoned): torch sums uint8 one byte at a time, ~50x slower, which would swamp what
    the bench times.
    Raises: AssertionError if a byte is not `fill` (the read went wrong, or the bytes).
    """
    n = value.numel()
    flat = value.reshape(-1)
    whole = n // 8 * 8
    try:
        words = flat[:whole].view(torch.int64)
    except RuntimeError:  # (bytes not 8-aligned in their storage: one at a time)
        ok = (int(flat.sum()) if n else 0) == fill * n
    else:
        word = int.from_bytes(bytes([fill]) * 8, "little")
        want = (whole // 8 * word + 2**63) % 2**64 - 2**63  # (int64 arithmetic wraps)
        ok = (int(words.sum()) if whole else 0) == want and int(flat[whole:].sum()) == fill * (n - whole)
    if not ok:
        raise AssertionError(f"read {n} bytes, not every one {fill}")
    return fill * n


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
    """Actor -> async actor fetch latency and bandwidth, ours and Ray's, cold and warm:
    the clock starts at a ref in hand (the producer's call returned) and stops when the
    consumer has read every byte (`fetch_read_s`; `fetch_s`: until the fetch returned)."""
    prod, cons = Producer.remote(), Consumer.remote()
    zprod = Producer.options(runtime_env=ZERO_COPY_ENV).remote()
    zcons = Consumer.options(runtime_env=ZERO_COPY_ENV).remote()
    ray.get([a.ready.remote() for a in (prod, zprod)] + [cons.ping.remote(), zcons.ping.remote()])
    cases = {
        "rdt auto (shm)": (prod, "rdt_auto", cons, "rdt"),
        "rdt auto, into=": (prod, "rdt_auto", cons, "into"),
        "rdt object_store": (prod, "rdt_object_store", cons, "rdt"),
        "ray object store": (prod, "plain", cons, "ray"),
        "ray object store, zero-copy torch": (zprod, "plain", zcons, "ray"),
    }

    def one(case: str, size: int) -> dict[str, float]:
        producer, method, consumer, mode = cases[case]
        ref = getattr(producer, method).remote(size)
        ray.wait([ref])
        return ray.get(consumer.fetch.remote([ref], mode, size))  # type: ignore[no-any-return]

    rows = []
    try:
        for size in sizes:  # (the cold round warms the actors' buffers and code)
            turns = take_turns({c: functools.partial(one, c, size) for c in cases}, repeat)
            for name in cases:
                warm = turns.warm[name]
                if not warm:
                    rows.append({"bench": "fetch", "case": name, "size": size, "error": turns.why(name) or "no warm run"})
                    continue
                med = {k: statistics.median(s[k] for s in warm) for k in warm[0]}
                row = {
                    "bench": "fetch",
                    "case": name,
                    "size": size,
                    "cold_fetch_s": turns.cold[name]["fetch"],
                    "fetch_s": med["fetch"],
                    "fetch_read_s": med["fetch_read"],
                    "gib_s": size / med["fetch_read"] / 2**30,
                    "max_loop_lag_ms": max(s["max_lag"] for s in warm) * 1000,
                    "passes_s": [round(s["fetch_read"], 6) for s in warm],
                    "turns": turns.turns[name],
                }
                if name in turns.broke:
                    row["broke"] = turns.why(name)
                rows.append(row)
    finally:
        for a in (prod, zprod, cons, zcons):
            ray.kill(a)
    return rows


def pass_rows(size: int, repeat: int) -> list[dict[str, Any]]:
    """Driver-submitted actor -> actor pass of one object, end to end (4 KB: overheads), the paths in turns."""
    prod, cons = Producer.remote(), Consumer.remote()
    ray.get([prod.ready.remote(), cons.ping.remote()])
    try:
        cases = {name: (prod, cons, method) for name, method in (("rdt auto", "rdt_auto"), ("ray object store", "plain"))}
        return [{"bench": "pass", "case": name, "size": size, "seconds": s} for name, s in _passes_s(cases, size, repeat).items()]
    finally:
        ray.kill(prod)
        ray.kill(cons)


def _passes_s(cases: dict[str, tuple[Any, Any, str]], size: int, repeat: int) -> dict[str, float]:
    """Median seconds of a pass for each case (producer, consumer, method), the cases in
    turns: `producer.method(size)` handed to the consumer, which reads every byte of it."""

    def one(producer: Any, consumer: Any, method: str) -> float:
        t0 = time.perf_counter()
        ray.get(consumer.take.remote(getattr(producer, method).remote(size)))
        return time.perf_counter() - t0

    turns = take_turns({name: functools.partial(one, *c) for name, c in cases.items()}, max(repeat * 10, 20))
    if turns.broke:
        name, (_, e) = next(iter(turns.broke.items()))
        raise RuntimeError(f"{name}: {turns.why(name)}") from e
    return {name: statistics.median(turns.warm[name]) for name in cases}


def metrics_rows(repeat: int, size: int = 4 << 10) -> list[dict[str, Any]]:
    """What Ray metrics cost: a 4 KiB pass with them on and off (in turns), and one fetch's recording alone."""
    cases: dict[str, tuple[Any, Any, str]] = {}
    try:
        for case, env in (("rdt auto, metrics on", {}), ("rdt auto, RDT_METRICS=0", {"RDT_METRICS": "0"})):
            opts = {"runtime_env": {"env_vars": env}} if env else {}
            cases[case] = (Producer.options(**opts).remote(), Consumer.options(**opts).remote(), "rdt_auto")
            ray.get([cases[case][0].ready.remote(), cases[case][1].ping.remote()])
        rows: list[dict[str, Any]] = [{"bench": "metrics", "case": case, "size": size, "seconds": s}
                                      for case, s in _passes_s(cases, size, repeat).items()]
        on = cases["rdt auto, metrics on"][1]
        rows[0].update({f"record_fetch_{k}": v for k, v in ray.get(on.record_fetch_us.remote()).items()})
        return rows
    finally:
        for prod, cons, _ in cases.values():
            ray.kill(prod)
            ray.kill(cons)


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
