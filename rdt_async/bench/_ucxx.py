"""UCXX benchmarks: ours against UCXX's own asyncio API, and against Ray's object store.

Baseline: two plain processes using `ucxx.create_listener` / `create_endpoint` and
`await ep.send` / `ep.recv` into a warm buffer, as a user would write it (UCXX's
default progress thread). Ours: `rdt.fetch` between two actors over `tensor_transport=
"ucxx"`, warm `into=` buffers and fresh ones, a 4 KiB fetch, and the CPU an idle
process with a UCX worker burns. `vs_raw`: our time over UCXX's own (below 1: ours faster).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import statistics
import time
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._turns import take_turns


def _raw_server(q: Any, sizes: list[int]) -> None:
    import numpy as np
    import ucxx

    async def main() -> None:
        bufs = {n: np.ones(n, dtype=np.uint8) for n in sizes}
        done = asyncio.Event()

        async def serve(ep: Any) -> None:
            header = np.empty(1, dtype=np.uint64)
            while True:
                await ep.recv(header)
                n = int(header[0])
                if n == 0:
                    break
                await ep.send(bufs[n])
            await ep.close()
            done.set()

        listener = ucxx.create_listener(serve)
        q.put(listener.port)
        await done.wait()

    asyncio.run(main())


def _raw_client(port: int, q: Any, sizes: list[int], repeat: int) -> None:
    import numpy as np
    import ucxx

    async def main() -> dict[int, float]:
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        out = {}
        for n in sizes:
            buf = np.zeros(n, dtype=np.uint8)
            times = []
            for i in range(repeat + 1):
                t0 = time.perf_counter()
                await ep.send(np.array([n], dtype=np.uint64))
                await ep.recv(buf)
                if i:
                    times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
        await ep.send(np.array([0], dtype=np.uint64))
        return out

    q.put(asyncio.run(main()))


def raw_ucxx(sizes: list[int], repeat: int) -> dict[int, float]:
    """Median seconds of a warm request + receive with UCXX's own asyncio API."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_raw_server, args=(q, sizes))
    server.start()
    port = q.get(timeout=120)
    client = ctx.Process(target=_raw_client, args=(port, q, sizes, repeat))
    client.start()
    res: dict[int, float] = q.get(timeout=600)
    client.join(60)
    server.join(60)
    for p in (client, server):
        if p.is_alive():
            p.kill()
    return res


@rdt.remote
class Producer:
    def __init__(self) -> None:
        self.t: dict[int, torch.Tensor] = {}

    @rdt.method(tensor_transport="ucxx")
    def make(self, n: int) -> torch.Tensor:
        if n not in self.t:
            self.t[n] = torch.ones(n, dtype=torch.uint8)
        return self.t[n]

    def idle_cpu(self, seconds: float) -> float:
        return _idle_cpu(seconds)


@rdt.remote
class Consumer:
    def __init__(self) -> None:
        self.buf: dict[int, torch.Tensor] = {}

    async def timed(self, refs: list[Any], into: bool) -> float:
        obj = await refs[0]
        n = obj.specs[0].shape[0]
        buf = self.buf.setdefault(n, torch.zeros(n, dtype=torch.uint8)) if into else None
        t0 = time.perf_counter()
        await rdt.fetch(obj, into=buf)
        return time.perf_counter() - t0

    def idle_cpu(self, seconds: float) -> float:
        return _idle_cpu(seconds)


def _fetch_s(producer: Any, consumer: Any, n: int, into: bool) -> float:
    took: float = ray.get(consumer.timed.remote([producer.make.remote(n)], into))
    return took


def _idle_cpu(seconds: float) -> float:
    t0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - t0


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    big = [s for s in sizes if s >= 1 << 20] or [64 << 20]
    rows: list[dict[str, Any]] = []
    raw = raw_ucxx([4096, *big], repeat)
    p, c = Producer.remote(), Consumer.remote()
    try:
        for n in [4096, *big]:
            # into= buffers and fresh ones in turns, each after a cold fetch (4 KiB: fresh only)
            cases = {"rdt ucxx fetch, into=": True, "rdt ucxx fetch": False} if n > 4096 else {"rdt ucxx fetch": False}
            turns = take_turns({case: functools.partial(_fetch_s, p, c, n, into) for case, into in cases.items()}, repeat)
            for case in cases:
                if case in turns.broke:
                    raise RuntimeError(f"{case}: {turns.why(case)}") from turns.broke[case][1]
                med = statistics.median(turns.warm[case])
                rows.append({"bench": "ucxx", "case": case, "size": n, "seconds": med,
                             "gib_s": n / med / 2**30, "vs_raw": med / raw[n]})  # fmt: skip
            rows.append({"bench": "ucxx", "case": "raw ucxx ep.send/ep.recv", "size": n, "seconds": raw[n],
                         "gib_s": n / raw[n] / 2**30})  # fmt: skip
        idle = ray.get([p.idle_cpu.remote(3.0), c.idle_cpu.remote(3.0)])
        rows.append({"bench": "ucxx", "case": "idle CPU s/s, producer and consumer", "size": 0,
                     "seconds": 3.0, "cpu_per_s": [round(x / 3.0, 4) for x in idle]})  # fmt: skip
    finally:
        for a in (p, c):
            ray.kill(a)
    return rows
