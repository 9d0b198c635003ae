"""`auto`: what a producer prepares an object for, and the transport a fetch takes, by
what each transport declares (`Transport.auto_costs`, `auto_prepares`, `reach`, ...) and
what each path costs. No transport is named here: one a user registers gets what the
built-ins get.

Ray-free: the caller states the facts (size, devices, same node or not, what the producer
prepared, what loads here, a group both ends share) and gets a `Choice` that says what
was picked, why, and what every candidate was expected to cost; a producer gets the
transport classes to prepare an object for (`plan`).

The cost of a path is `latency + bytes / bandwidth`, fitted to end-to-end passes (clock
from the producing call until the consumer has read every byte) by
`python -m rdt_async.bench --only e2e [--hosts 2] --write-costs FILE` (its `plain` shape's
passes). The built-ins'
declared costs were measured so on a 2-core VM (CPU tensors, 2026-11-23; "hosts" over a
veth link between network namespaces) and one H200 (GPU tensors on one node,
2026-11-27); `RDT_AUTO_COSTS=FILE` makes every process use the costs measured on your
machines instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from ._base import Cost, GiB, Transport
from ._registry import FALLBACK, known_class, known_classes

__all__ = ["Choice", "Cost", "Facts", "candidates", "choose", "cost_table", "may_take", "plan"]

TransportClass = type[Transport[Any]]
PLACES = ("node", "hosts")  # a consumer on the producer's node; on another


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
    table = costs if costs is not None else cost_table(f.gpu, candidates(f))
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


def cost_table(gpu: bool, names: Iterable[str] | None = None) -> dict[str, Cost]:
    """"<transport>/<node|hosts>" -> Cost for CPU or GPU tensors: what the transports
    `names` declare (default: every one this process knows, see `_registry.known_classes`),
    with what the file RDT_AUTO_COSTS names laid over them."""
    names = None if names is None else list(names)
    classes = known_classes() if names is None else [c for c in map(known_class, names) if c is not None]
    kind = "gpu" if gpu else "cpu"
    declared = {
        f"{c.name}/{where}": cost
        for c in classes
        for where in PLACES
        if (cost := c.auto_costs.get(f"{kind}/{where}")) is not None
    }
    overrides = _overrides(os.environ.get("RDT_AUTO_COSTS", ""), gpu)
    if names is not None:
        overrides = {k: v for k, v in overrides.items() if k.rpartition("/")[0] in names}
    return {**declared, **overrides}


def plan(
    classes: Sequence[TransportClass],
    devices: Collection[str],
    nbytes: int,
    several_nodes: bool,
    exports: Callable[[TransportClass], bool],
) -> list[TransportClass]:
    """What a producer's `auto` prepares an object of `nbytes` on `devices` (torch device
    types) for, of `classes`: those that say `auto_prepares`, move tensors on all of
    `devices` and take objects of this size (`auto_min_bytes`, `auto_max_bytes`), and
    `exports(cls)` (asked only of those that would be prepared, cheapest first: asking
    may load a library).

    One whose bytes ride in the ref (`carries_bytes`) is prepared alone. Otherwise: for
    consumers on this node, the cheapest; on a cluster of several nodes, also the cheapest
    that reaches other nodes, and every one that `prepares_freely` (their fallback).
    Nothing where none fits: consumers read through the object store.
    """
    kind = "cpu" if set(devices) <= {"cpu"} else "gpu"
    fit = [c for c in classes if _takes(c, devices, nbytes)]
    for c in fit:
        if c.carries_bytes and exports(c):
            return [c]
    out = [_cheapest(fit, kind, "node", nbytes, exports)]
    if several_nodes:
        reaching = [c for c in fit if c.reach == "cluster"]
        out.append(_cheapest(reaching, kind, "hosts", nbytes, exports))
        out += [c for c in reaching if c.prepares_freely and _cost(c, kind, "hosts") is not None and exports(c)]
    return [c for c in dict.fromkeys(out) if c is not None]


def may_take(cls: TransportClass, classes: Sequence[TransportClass], kinds: Iterable[str], several_nodes: bool) -> bool:
    """Whether a producer's `auto` may prepare objects for `cls` (of `classes`) at some size
    for consumers on other nodes, for tensors of `kinds` ("cpu", "gpu"): what an actor
    loads at creation (`Transport.warm_at_creation`)."""
    if not (several_nodes and cls.auto_prepares and cls.reach == "cluster"):
        return False
    for kind in kinds:
        devices = ("cpu",) if kind == "cpu" else ("cuda",)
        mine = _cost(cls, kind, "hosts")
        if mine is None or not _takes(cls, devices, cls.auto_min_bytes):
            continue
        rivals = [
            r for c in classes
            if c is not cls and c.auto_prepares and c.reach == "cluster" and set(devices) <= set(c.devices)
            and (r := _cost(c, kind, "hosts")) is not None
        ]
        at = max(cls.auto_min_bytes, 1)
        if cls.prepares_freely or all(mine.seconds(at) < r.seconds(at) or mine.gib_s > r.gib_s for r in rivals):
            return True
    return False


def _takes(cls: TransportClass, devices: Collection[str], nbytes: int) -> bool:
    return (
        cls.auto_prepares
        and set(devices) <= set(cls.devices)
        and cls.auto_min_bytes <= nbytes
        and (cls.auto_max_bytes is None or nbytes <= cls.auto_max_bytes)
    )


def _cost(cls: TransportClass, kind: str, where: str) -> Cost | None:
    """`cls`'s cost, RDT_AUTO_COSTS's where that file has one."""
    overrides = _overrides(os.environ.get("RDT_AUTO_COSTS", ""), kind == "gpu")
    return overrides.get(f"{cls.name}/{where}") or cls.auto_costs.get(f"{kind}/{where}")


def _cheapest(
    classes: Sequence[TransportClass], kind: str, where: str, nbytes: int, exports: Callable[[TransportClass], bool]
) -> TransportClass | None:
    """The one expected to fetch `nbytes` fastest at `where` that exports here (earlier wins ties)."""
    costed = [(cost.seconds(nbytes), i, c) for i, c in enumerate(classes) if (cost := _cost(c, kind, where)) is not None]
    return next((c for _, _, c in sorted(costed, key=lambda x: x[:2]) if exports(c)), None)


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
        tables = {dev: {k: Cost(float(v[0]), float(v[1])) for k, v in data.get(dev, {}).items()} for dev in ("cpu", "gpu")}
    except (OSError, ValueError, TypeError, IndexError, AttributeError, KeyError) as e:
        raise ValueError(f"cannot read costs from it ({type(e).__name__}: {e})") from e
    for dev, table in tables.items():
        for key, cost in table.items():
            if not (math.isfinite(cost.latency_s) and cost.latency_s >= 0 and math.isfinite(cost.gib_s) and cost.gib_s > 0):
                raise ValueError(  # (a bandwidth of 0 divided every choice by zero; a negative one won them all)
                    f"its {dev} cost {key!r} is [{cost.latency_s}, {cost.gib_s}]: give [latency_s, GiB/s], a "
                    "latency of 0 or more and a bandwidth above 0, both finite"
                )
    return tables


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
