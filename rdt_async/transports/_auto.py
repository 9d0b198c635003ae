"""`auto`: the transport a fetch takes, by what both ends can use and what each path costs.

Ray-free: the caller states the facts (size, devices, same node or not, what the producer
prepared, what loads here, a group both ends share) and gets a `Choice` that says what
was picked, why, and what every candidate was expected to cost.

The cost of a path is `latency + bytes / bandwidth`, fitted to end-to-end passes (clock
from the producing call until the consumer has read every byte) by
`python -m rdt_async.bench --only e2e [--hosts 2] --write-costs FILE`. The defaults below
were measured so on a 2-core VM; `RDT_AUTO_COSTS=FILE` makes every process use the costs
measured on your machines instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
from collections.abc import Callable, Iterable, Mapping

from ._registry import FALLBACK

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Cost:
    """One fetch over a path: a fixed latency, then bytes at a bandwidth."""

    latency_s: float
    gib_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gib_s * GiB)


# "<transport>/node" (same node) or "<transport>/hosts" (another node) -> Cost, CPU tensors.
# Fitted to `--only e2e --e2e-sizes 4K,1M,16M,64M` (kept and fresh tensors, one consumer),
# one run each, 2-core VM, 2026-11-23; "hosts" over a veth link between network namespaces.
CPU_COSTS: dict[str, Cost] = {
    "shm/node": Cost(0.0039, 2.30),
    "nixl/node": Cost(0.0043, 1.98),
    "gloo/node": Cost(0.0055, 1.33),
    "object_store/node": Cost(0.0055, 0.81),
    "nixl/hosts": Cost(0.0072, 0.86),
    "tcp/hosts": Cost(0.0048, 1.52),
    "tcp/node": Cost(0.0042, 1.72),
    "gloo/hosts": Cost(0.0062, 1.03),
    "object_store/hosts": Cost(0.0064, 0.30),
}
# GPU tensors. "node": fitted to `python -m rdt_async.bench.gpu` fetches (fresh tensors, 64
# MiB-4 GiB, two processes on one H200, two runs on two machines of 2026-11-27 averaged,
# after cuda_ipc moved to the caller's loop; a fetch of a prepared object, no Ray).
# The rest is not measured (one GPU, no Ray there): the order by design, one-sided NIXL,
# then a group's NCCL, then the object store (through host memory).
GPU_COSTS: dict[str, Cost] = {
    "cuda_ipc/node": Cost(0.0003, 1830.0),
    "nixl/node": Cost(0.00117, 1900.0),
    "nixl/hosts": Cost(0.004, 10.0),
    "nccl/node": Cost(0.004, 40.0),
    "nccl/hosts": Cost(0.006, 8.0),
    "object_store/node": Cost(0.010, 1.0),
    "object_store/hosts": Cost(0.012, 0.5),
}


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a fetch's choice depends on."""

    nbytes: int
    gpu: bool  # any tensor on a GPU
    same_node: bool
    prepared: frozenset[str]  # transports the producer prepared the object for
    loads_here: frozenset[str]  # of those, the ones this process can use (see choose_checked)
    group: str | None = None  # backend of a usable group both ends are in
    node_local: frozenset[str] = frozenset()  # of `prepared`, those that reach one node only
    in_ref: frozenset[str] = frozenset()  # of `prepared`, those whose bytes came with the ref


@dataclasses.dataclass(frozen=True)
class Choice:
    transport: str
    why: str
    estimates: Mapping[str, float] = dataclasses.field(default_factory=dict)  # seconds, candidates only
    # Paths this fetch tried first and could not use with its producer: (transport, why).
    fell_back: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"transport": self.transport, "why": self.why,
                                  "estimates_ms": {k: round(v * 1e3, 3) for k, v in self.estimates.items()}}
        if self.fell_back:
            out["fell_back"] = [{"transport": t, "why": why} for t, why in self.fell_back]
        return out


def candidates(f: Facts) -> list[str]:
    """Every transport both ends can use for this object: what the producer prepared that
    loads here (node-local ones on its node only, first), a shared group, and the object
    store, which always can."""
    usable = [n for n in f.prepared & f.loads_here if f.same_node or n not in f.node_local]
    out = sorted(usable, key=lambda n: (n not in f.node_local, n))
    if f.group is not None:
        out.append(f.group)
    out.append(FALLBACK)
    return out


def choose(f: Facts, costs: Mapping[str, Cost] | None = None) -> Choice:
    """The candidate expected to finish first; ties go to the earlier one in `candidates`."""
    carried = sorted(f.prepared & f.in_ref)
    if carried:
        return in_ref(carried[0])
    table = costs if costs is not None else cost_table(f.gpu)
    where = "node" if f.same_node else "hosts"
    estimates = {}
    for name in candidates(f):
        cost = table.get(f"{name}/{where}")
        if cost is not None:
            estimates[name] = cost.seconds(f.nbytes)
    if not estimates:
        return Choice(FALLBACK, f"no cost known for {candidates(f)} ({where}): the object store always works")
    best = min(estimates, key=lambda n: estimates[n])
    ranked = " < ".join(f"{n} {estimates[n] * 1e3:.3g} ms" for n in sorted(estimates, key=lambda n: estimates[n]))
    place = "this node" if f.same_node else "another node"
    return Choice(best, f"{_size(f.nbytes)} {'GPU' if f.gpu else 'CPU'} from {place}: {ranked}", estimates)


@functools.cache
def in_ref(name: str) -> Choice:
    """The choice of an object whose bytes came with the ref (over `name`): nothing beats it."""
    return Choice(name, "small: the bytes came with the ref")


def may_beat(name: str, other: str, *, gpu: bool = False, min_bytes: int = 1 << 20) -> bool:
    """Whether, by the cost table, transport `name` reads objects of another node of
    `min_bytes` or more faster than `other` does at some size (both costs known)."""
    table = cost_table(gpu)
    a, b = table.get(f"{name}/hosts"), table.get(f"{other}/hosts")
    if a is None or b is None:
        return a is not None
    return a.seconds(min_bytes) < b.seconds(min_bytes) or a.gib_s > b.gib_s


def choose_checked(f: Facts, loads: Callable[[str], bool], costs: Mapping[str, Cost] | None = None) -> Choice:
    """`choose`, taking `f.loads_here` as a guess and asking `loads(name)` only of a winner in it.

    Whether a transport loads here can cost an import (NIXL: ~0.5 s with the GIL held,
    and its UCX build): a fetch that shared memory wins never asks.
    """
    maybe = set(f.loads_here)
    while True:
        choice = choose(dataclasses.replace(f, loads_here=frozenset(maybe)), costs)
        if choice.transport not in maybe or loads(choice.transport):
            return choice
        maybe.discard(choice.transport)


def choose_remembered(f: Facts, loads: Callable[[str], bool]) -> Choice:
    """`choose_checked` with the process's cost table, remembered per (facts, RDT_AUTO_COSTS):
    a fetch like the last one (a weight sync) pays a dict lookup, not the cost model.
    `loads` must answer the same for a name every time (as `_produce.loads_here` does)."""
    return _remembered(f, os.environ.get("RDT_AUTO_COSTS", ""), loads)


@functools.lru_cache(maxsize=512)
def _remembered(f: Facts, costs_path: str, loads: Callable[[str], bool]) -> Choice:
    return choose_checked(f, loads)


def cost_table(gpu: bool) -> dict[str, Cost]:
    """The defaults, with what the file RDT_AUTO_COSTS names laid over them."""
    return {**(GPU_COSTS if gpu else CPU_COSTS), **_overrides(os.environ.get("RDT_AUTO_COSTS", ""), gpu)}


@functools.cache
def _overrides(path: str, gpu: bool) -> dict[str, Cost]:
    if not path:
        return {}
    try:
        return read_costs(path)["gpu" if gpu else "cpu"]
    except ValueError as e:
        raise ValueError(
            f"RDT_AUTO_COSTS={path!r}: {e}; unset RDT_AUTO_COSTS (or name a good file), then write "
            "one with `python -m rdt_async.bench --only e2e --write-costs FILE`"
        ) from e


def read_costs(path: str) -> dict[str, dict[str, Cost]]:
    """A cost file's tables, {"cpu": {...}, "gpu": {...}}. Raises ValueError saying what is wrong."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        return {dev: {k: Cost(float(v[0]), float(v[1])) for k, v in data.get(dev, {}).items()} for dev in ("cpu", "gpu")}
    except (OSError, ValueError, TypeError, IndexError, AttributeError, KeyError) as e:
        raise ValueError(f"cannot read costs from it ({type(e).__name__}: {e})") from e


def fit(points: Iterable[tuple[int, float]]) -> Cost | None:
    """`latency + bytes / bandwidth` through (nbytes, seconds) points, by relative error.

    The median time of each size is fitted, each weighted by 1/t^2, so that a 4 KiB pass
    counts as much as a 256 MiB one and one slow pass does not move the line.
    """
    by_size: dict[int, list[float]] = {}
    for n, t in points:
        by_size.setdefault(n, []).append(t)
    if len(by_size) < 2:
        return None
    pts = [(n, statistics.median(ts)) for n, ts in by_size.items()]
    w = [1.0 / (t * t) for _, t in pts]
    sw = sum(w)
    mean_n = sum(wi * n for wi, (n, _) in zip(w, pts)) / sw
    mean_t = sum(wi * t for wi, (_, t) in zip(w, pts)) / sw
    var = sum(wi * (n - mean_n) ** 2 for wi, (n, _) in zip(w, pts))
    slope = sum(wi * (n - mean_n) * (t - mean_t) for wi, (n, t) in zip(w, pts)) / var
    if slope <= 0:
        return None
    return Cost(max(0.0, mean_t - slope * mean_n), 1.0 / (slope * GiB))


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"
