"""Gloo benchmarks: ours against raw ProcessGroupGloo send/recv and Ray 2.60's Gloo RDT.

Every ratio (`vs_*`) is a time ratio, ours over theirs: below 1, rdt_async is faster.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._core import read_all
from ._turns import take_turns


def _raw_peer(rank: int, port: int, sizes: list[int], repeat: int, out: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=120)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, opts)
    results = {}
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8) if rank == 0 else torch.empty(size, dtype=torch.uint8)
        t.fill_(rank)  # warm
        times = []
        for i in range(repeat + 1):
            flag = torch.zeros(1)
            if rank == 0:
                pg.recv([flag], 1, 1000 + i).wait()  # receiver ready
                pg.send([t], 1, i).wait()
            else:
                t0 = time.perf_counter()
                pg.send([flag], 0, 1000 + i).wait()
                pg.recv([t], 0, i).wait()
                times.append(time.perf_counter() - t0)
        if rank == 1:
            results[size] = statistics.median(times[1:])
    if rank == 1:
        out.put(results)
    del pg


def raw_gloo(sizes: list[int], repeat: int) -> dict[int, float]:
    """Median seconds of a warm raw send/recv between two plain processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_raw_peer, args=(r, port, sizes, repeat, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res: dict[int, float] = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return res


@rdt.remote
class OurProducer:
    def __init__(self) -> None:
        self.t: dict[int, torch.Tensor] = {}

    @rdt.method(tensor_transport="gloo")
    def make(self, n: int) -> torch.Tensor:
        if n not in self.t:
            self.t[n] = torch.ones(n, dtype=torch.uint8)
        return self.t[n]

    def raw_send(self, group: str, n: int, i: int) -> None:
        """Raw send/recv on rdt's own process group, in this same process (rank 0)."""
        pg = _pg(group)
        pg.recv([torch.zeros(1)], 1, RAW_TAG + 2 * i).wait()  # the receiver is ready
        if n not in self.t:
            self.t[n] = torch.ones(n, dtype=torch.uint8)
        pg.send([self.t[n]], 1, RAW_TAG + 2 * i + 1).wait()


RAW_TAG = (1 << 31) - (1 << 20)  # tags are int32: far above what rdt's transfers reach here


def _pg(group: str) -> Any:
    from rdt_async.transports import gloo

    found = gloo.groups.get(group)
    assert found is not None
    return found.pg


@rdt.remote
class OurConsumer:
    def __init__(self) -> None:
        self.buf: dict[int, torch.Tensor] = {}

    async def take(self, value: Any) -> int:
        """Read every byte of what arrived (the producer's ones)."""
        return read_all(value, 1)

    async def timed(self, refs: list[Any], together: bool) -> float:
        objs = [await r for r in refs]
        t0 = time.perf_counter()
        if together:
            await rdt.fetch_all(objs)
        else:
            for o in objs:
                await rdt.fetch(o)
        return time.perf_counter() - t0

    async def raw_recv(self, group: str, n: int, i: int) -> float:
        pg = _pg(group)
        buf = self.buf.setdefault(n, torch.zeros(n, dtype=torch.uint8))
        await asyncio.sleep(0.02)  # the sender's call has started and waits: time no Ray skew
        t0 = time.perf_counter()
        pg.send([torch.zeros(1)], 0, RAW_TAG + 2 * i).wait()
        pg.recv([buf], 0, RAW_TAG + 2 * i + 1).wait()
        return time.perf_counter() - t0

    async def fetch_into(self, refs: list[Any]) -> float:
        obj = await refs[0]
        n = obj.specs[0].shape[0]
        buf = self.buf.setdefault(n, torch.zeros(n, dtype=torch.uint8))
        t0 = time.perf_counter()
        await rdt.fetch(obj, into=buf)
        return time.perf_counter() - t0


@ray.remote(enable_tensor_transport=True)
class RayProducer:
    def __init__(self) -> None:
        self.t: dict[int, torch.Tensor] = {}

    @ray.method(tensor_transport="gloo")
    def make(self, n: int) -> torch.Tensor:
        if n not in self.t:
            self.t[n] = torch.ones(n, dtype=torch.uint8)
        return self.t[n]


@ray.remote(enable_tensor_transport=True)
class RayConsumer:
    def take(self, value: Any) -> int:
        """Read every byte of what arrived (the producer's ones)."""
        return read_all(value, 1)


def _pass_time(producer: Any, consumer: Any, size: int) -> float:
    """Seconds of one pass: the producing call until the consumer has read every byte."""
    t0 = time.perf_counter()
    ray.get(consumer.take.remote(producer.make.remote(size)))
    return time.perf_counter() - t0


def _medians(passes: dict[str, Any], repeat: int) -> dict[str, float]:
    """The warm median of each of `passes` (callables returning seconds), in turns after a
    cold round. Raises what broke a pass."""
    turns = take_turns(passes, repeat)
    for name, (_, e) in turns.broke.items():
        raise RuntimeError(f"gloo {name}: {turns.why(name)}") from e
    return {name: statistics.median(turns.warm[name]) for name in passes}


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    sizes = [s for s in sizes if s >= 64 << 20] or [64 << 20]
    rows: list[dict[str, Any]] = []
    raw = raw_gloo(sizes, repeat)
    ours_p, ours_c = OurProducer.remote(), OurConsumer.remote()
    group = rdt.create_collective_group([ours_p, ours_c])
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    ray_p, ray_c = RayProducer.remote(), RayConsumer.remote()
    ray_group = create_collective_group([ray_p, ray_c], backend="torch_gloo")
    try:
        tags = itertools.count()

        def raw_in_actors(size: int) -> float:  # raw send/recv on the group's own process group
            i = next(tags)
            took: float = ray.get([ours_p.raw_send.remote(group.name, size, i), ours_c.raw_recv.remote(group.name, size, i)])[1]
            return took

        for size in sizes:
            # In the same two actors, in turns: raw send/recv on the group's own process
            # group, an rdt fetch into a warm buffer; each after a cold one.
            med = _medians({"raw": functools.partial(raw_in_actors, size),
                            "fetch": lambda size=size: ray.get(ours_c.fetch_into.remote([ours_p.make.remote(size)]))},
                           repeat)
            rows.append({"bench": "gloo", "case": "raw ProcessGroupGloo send/recv", "size": size,
                         "seconds": raw[size], "gib_s": size / raw[size] / 2**30})
            rows.append({"bench": "gloo", "case": "raw send/recv on the group's pg, same actors", "size": size,
                         "seconds": med["raw"], "gib_s": size / med["raw"] / 2**30})
            rows.append({"bench": "gloo", "case": "rdt gloo fetch, into=", "size": size,
                         "seconds": med["fetch"], "gib_s": size / med["fetch"] / 2**30, "vs_raw": med["fetch"] / raw[size],
                         "vs_raw_same_actors": med["fetch"] / med["raw"]})
            passes = _medians({"ours": functools.partial(_pass_time, ours_p, ours_c, size),
                               "theirs": functools.partial(_pass_time, ray_p, ray_c, size)}, repeat)
            ours, theirs = passes["ours"], passes["theirs"]
            rows.append({"bench": "gloo", "case": "rdt gloo actor->actor pass", "size": size, "seconds": ours,
                         "vs_ray": ours / theirs})
            rows.append({"bench": "gloo", "case": "ray 2.60 gloo RDT pass", "size": size, "seconds": theirs})
        n, each = 16, 16 << 20
        one = [ray.get(ours_c.timed.remote([ours_p.make.remote(each) for _ in range(n)], False)) for _ in range(repeat)]
        many = [ray.get(ours_c.timed.remote([ours_p.make.remote(each) for _ in range(n)], True)) for _ in range(repeat)]
        rows.append({"bench": "gloo", "case": "16 x 16 MiB one by one", "size": n * each, "seconds": statistics.median(one)})
        rows.append({"bench": "gloo", "case": "16 x 16 MiB concurrent", "size": n * each, "seconds": statistics.median(many)})
    finally:
        rdt.destroy_collective_group(group)
        destroy_collective_group(ray_group)
        for a in (ours_p, ours_c, ray_p, ray_c):
            ray.kill(a)
    return rows


