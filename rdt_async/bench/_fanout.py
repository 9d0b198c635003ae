"""Fan-out across hosts: one producer, consumers on two other hosts (a weight sync to inference actors).

`python -m rdt_async.bench --hosts three --only fanout`: the producer on the head host, 8
async consumers (4 on each of the two other hosts) receive one object of each size, by
paths in turns: `rdt auto` (each fetches the ref it is
given), `rdt auto, into=` (each fetches into its own warm buffers, as a model loads its
weights) and Ray's zero-copy object store (each gets the ref as its argument; Ray pulls
the object to a node once), the order of each round from `_turns.in_turns` (a settle
after each pass; each row keeps its warm passes' seconds, `passes_s`, and its place in
each round, `turns`; a path that breaks keeps the passes it finished and says what
`broke`). The clock runs from the producing call until every consumer
has read every byte. Each row carries the consumers' worst event-loop stall while the
object arrived (`loop_stall_ms`; `loop_held_ms`: the same less the loop thread's waits for
a core, as 8 consumers copying on a 2-core machine wait) and what the node relay did: how many fetches of the
object crossed the link (`link_transfers`, the rest mapped a neighbour's copy:
`relayed`), median over the warm passes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

import rdt_async as rdt

from .. import _relay
from ..transports import _mappings
from ._loop import LoopStall
from ._progress import Progress
from ._turns import end_actors, take_turns
from ._units import human

HOSTS = ("remote", "remote2")  # the resources of the two consumer hosts of `--hosts three`
PER_HOST = 4
PARTS = 8  # the object is a dict of this many tensors, as a model's weights
RAY_ZERO_COPY = "ray object store zero-copy"
PATHS = ("rdt auto", "rdt auto, into=", RAY_ZERO_COPY)
ZERO_COPY_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


def _weights(size: int) -> dict[str, torch.Tensor]:
    n = max(1, size // 4 // PARTS)
    return {f"layer{i}": torch.full((n,), 1.0) for i in range(PARTS)}


def placements() -> list[dict[str, Any]]:
    """Actor options for the consumers: `PER_HOST` on each of the two consumer hosts."""
    return [{"num_cpus": 0, "resources": {h: 1}} for h in HOSTS for _ in range(PER_HOST)]


def vs_ray_zero_copy(rows: list[dict[str, Any]]) -> None:
    """Give each timed row its ratio to the Ray zero-copy row's `seconds` (if that one ran)."""
    ray_s = next((r["seconds"] for r in rows if r["case"] == RAY_ZERO_COPY and "seconds" in r), None)
    for row in rows:
        if ray_s and "seconds" in row:
            row["vs_ray_zero_copy"] = round(row["seconds"] / ray_s, 3)


def fetches_since(before: dict[str, int]) -> dict[str, int]:
    """This process's fetches by transport since `before` (an earlier `rdt.store_stats()["fetches"]`)."""
    after = rdt.store_stats()["fetches"]
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


@rdt.remote
class Trainer:
    """Keeps its weights in shared memory (as the docs ask) and publishes them."""

    def __init__(self) -> None:
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def _get(self, size: int) -> dict[str, torch.Tensor]:
        if size not in self.kept:
            self.kept[size] = {k: v.share_memory_() for k, v in _weights(size).items()}
        return self.kept[size]

    @rdt.method(tensor_transport="auto")
    def publish(self, size: int) -> dict[str, torch.Tensor]:
        return self._get(size)

    def publish_plain(self, size: int) -> dict[str, torch.Tensor]:
        return self._get(size)

    def drop(self) -> None:
        self.kept.clear()

    def pid(self) -> int:
        return os.getpid()


class _Loader:
    """An async inference actor: its model's tensors are allocated (and written) once per size."""

    weights = staticmethod(_weights)  # the model's tensors at a size

    def __init__(self) -> None:
        self.models: dict[int, dict[str, torch.Tensor]] = {}

    def model(self, size: int) -> dict[str, torch.Tensor]:
        if size not in self.models:
            self.models = {size: {k: torch.zeros_like(v) for k, v in self.weights(size).items()}}
        return self.models[size]

    def pid(self) -> int:
        """This actor's process (the bench waits for it to end once the actor is killed)."""
        return os.getpid()

    def drop(self) -> None:
        """Let go of this size's model and of the warm memory kept for it (the relay's idle
        memfds, kept mappings): the hosts share one machine, and the next size's passes
        need its memory (8 models of 1 GiB, after 256 MiB, were killed by Ray's OOM killer)."""
        self.models = {}
        self.forget_warm()

    @staticmethod
    def forget_warm() -> None:
        """Close the relay's idle memfds and the kept mappings now (as their idle sweep would)."""
        _relay.memfds.clear()
        _mappings.cache.clear()


@rdt.remote
class Loader(_Loader):
    async def load(self, refs: list[Any], size: int, into: bool) -> tuple[float, float, float, str]:
        """(sum of what arrived, the loop's worst stall while it arrived and that less its
        waits for a core, the path it took)."""
        model = self.model(size)
        before = dict(rdt.store_stats()["fetches"])
        stall = LoopStall()
        try:
            got = await rdt.fetch(refs[0], into=model if into else None)
        finally:
            stalled = stall.stop()
        used = next(iter(fetches_since(before)), "?")
        total = await asyncio.to_thread(lambda: sum(float(t.sum()) for t in got.values()))
        if into:
            assert all(got[k].data_ptr() == model[k].data_ptr() for k in model), "into= did not land in the model"
        return total, stalled, stall.held, used


@ray.remote
class RayLoader(_Loader):
    async def load(self, refs: list[Any], size: int, into: bool) -> tuple[float, float, float, str]:
        stall = LoopStall()
        try:
            got = await refs[0]
        finally:
            stalled = stall.stop()
        total = await asyncio.to_thread(lambda: sum(float(t.sum()) for t in got.values()))
        return total, stalled, stall.held, "ray"


def unavailable(hosts: int) -> str | None:
    """Why the fan-out across hosts cannot run on this cluster, or None."""
    return None if hosts >= 3 else "needs three hosts (--hosts three)"


Sized = Callable[[int], list[dict[str, Any]]]  # the rows at one size


def each_size(bench: str, paths: tuple[str, ...], sizes: list[int], hosts: int, progress: Progress | None,
              setup: Callable[[], tuple[list[Any], Sized]], what: str) -> list[dict[str, Any]]:
    """The rows of `bench` at every size (or rows that say why it cannot run on this cluster).

    `setup()` makes the actors (each has a `pid` method) and returns them with what runs
    one size; they are killed at the end, and their processes waited for. `what`: the
    progress bar's step, `{size}` in it.
    """
    progress = progress or Progress(False)
    why = unavailable(hosts)
    if why is not None:
        progress.note(f"{bench}: not run: {why}")
        return [{"bench": bench, "case": p, "skipped": why} for p in paths]
    progress.add(len(sizes))
    actors, one_size = setup()
    rows: list[dict[str, Any]] = []
    pids: list[int] = []
    try:
        pids = ray.get([a.pid.remote() for a in actors], timeout=180)
        for size in sizes:
            with progress.step(what.format(size=human(size))):
                rows += one_size(size)
    finally:
        end_actors(actors, pids)
    return rows


def run(sizes: list[int], repeat: int, hosts: int, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Every size, the paths in turns: a cold pass of each, then `repeat` rounds of warm ones."""

    def setup() -> tuple[list[Any], Sized]:
        trainer = Trainer.options(runtime_env=ZERO_COPY_ENV).remote()  # (the env matters to Ray's path only)
        loaders = {
            "rdt": [Loader.options(**w).remote() for w in placements()],
            "ray": [RayLoader.options(**w, runtime_env=ZERO_COPY_ENV).remote() for w in placements()],
        }

        def one_size(size: int) -> list[dict[str, Any]]:
            rows = _size(trainer, loaders, size, repeat)
            ray.get([trainer.drop.remote(), *(a.drop.remote() for a in loaders["rdt"] + loaders["ray"])])
            return rows

        return [trainer, *loaders["rdt"], *loaders["ray"]], one_size

    return each_size("fanout", PATHS, sizes, hosts, progress, setup,
                     f"fanout {{size}} to {len(HOSTS) * PER_HOST} consumers on 2 hosts, {len(PATHS)} paths in turns")


def _size(trainer: Any, loaders: dict[str, list[Any]], size: int, repeat: int) -> list[dict[str, Any]]:
    want = float(max(1, size // 4 // PARTS) * PARTS)
    turns = take_turns({p: functools.partial(_one_pass, p, trainer, loaders, size, want) for p in PATHS}, repeat)
    rows = []
    for path in PATHS:
        row: dict[str, Any] = {"bench": "fanout", "case": path, "size": size, "consumers": len(loaders["rdt"]), "hosts": 3}
        warm, why = turns.warm[path], turns.why(path)
        if not warm:
            rows.append({**row, "error": why or "no warm pass ran"})
            continue
        if path in turns.cold:
            row["cold_s"] = turns.cold[path]["seconds"]
        row.update({
            "seconds": statistics.median(p["seconds"] for p in warm),
            "loop_stall_ms": round(max(p["stall_s"] for p in warm) * 1e3, 3),
            "loop_held_ms": round(max(p["held_s"] for p in warm) * 1e3, 3),
        })
        if path != RAY_ZERO_COPY:
            row["link_transfers"] = statistics.median(p["link"] for p in warm)
            row["relayed"] = statistics.median(p["relayed"] for p in warm)
            row["paths"] = sorted({u for p in warm for u in p["used"]})
        row.update(passes_s=[round(p["seconds"], 6) for p in warm], turns=turns.turns[path])
        if why is not None:
            row["broke"] = why
        rows.append(row)
    vs_ray_zero_copy(rows)
    return rows


def _one_pass(path: str, trainer: Any, loaders: dict[str, list[Any]], size: int, want: float) -> dict[str, Any]:
    side = loaders["ray" if path == RAY_ZERO_COPY else "rdt"]
    t0 = time.perf_counter()
    ref = trainer.publish_plain.remote(size) if path == RAY_ZERO_COPY else trainer.publish.remote(size)
    out = ray.get([a.load.remote([ref], size, path.endswith("into=")) for a in side], timeout=600)
    took = time.perf_counter() - t0
    del ref
    if any(total != want for total, *_ in out):
        raise AssertionError(f"fanout {path}: read {[t for t, *_ in out]}, expected {want} each")
    used = [u for *_, u in out]
    return {"seconds": took, "stall_s": max(s for _, s, _, _ in out), "held_s": max(h for _, _, h, _ in out), "used": used,
            "link": sum(u != "relay" for u in used), "relayed": used.count("relay")}
