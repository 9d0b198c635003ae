"""Collectives benchmark: `rdt.allreduce` from the driver against the same allreduce written imperatively.

Four actors hold one float32 tensor each. The imperative version gives every actor a
standalone `ProcessGroupGloo` of its own; the driver triggers `pg.allreduce` on each
actor's tensor and waits for all four. The declarative version runs `rdt.allreduce` on
refs to the same tensors (a Gloo-transport RDT object per actor), over an rdt
collective group of the same four actors. Both run in one Ray session, interleaved.

Cases: `imperative pg.allreduce` (in place on the actor's tensor), `imperative copy +
pg.allreduce` (the same into a kept result buffer: the input stays intact, as with
`rdt.allreduce`, which is compared with both), `rdt.allreduce`
(a new object per holder, input untouched: one copy into a buffer the member reuses
once the previous result is freed), `rdt.allreduce inplace=True` (reduces into the
inputs, like the imperative one), and `rdt.allreduce cold` (the first call, whose
buffers are fresh memory: these VMs fault fresh memory in at ~0.3 GiB/s).
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import ray
import torch

import rdt_async as rdt

ACTORS = 4
MAX_BYTES = 64 << 20  # the size; larger sizes of --sizes are left out (4 actors on 2 cores)


@rdt.remote
class Worker:
    """A data-parallel worker: one gradient tensor, and a raw Gloo group for the imperative case."""

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self.outs: dict[int, torch.Tensor] = {}
        self.pg: Any = None
        self.store: Any = None

    def fill(self, numel: int) -> None:
        self.grads[numel] = torch.ones(numel, dtype=torch.float32)  # written once: warm

    @rdt.method(tensor_transport="gloo")
    def grad(self, numel: int) -> torch.Tensor:
        return self.grads[numel]

    def host_store(self) -> tuple[str, int]:
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        return host, int(self.store.port)

    def join_raw(self, rank: int, size: int, host: str, port: int) -> None:
        import torch.distributed as dist

        store = self.store or dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=120)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bench-raw", store), rank, size, opts)

    def raw_allreduce(self, numel: int, out_of_place: bool = False) -> None:
        t = self.grads[numel]
        if out_of_place:  # into a kept result buffer, leaving the input as it was
            t = self.outs.setdefault(numel, torch.empty_like(t)).copy_(t)
        self.pg.allreduce([t]).wait()

    def leave_raw(self) -> None:
        self.pg, self.store = None, None


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """Time a 4-actor float32 allreduce: imperative pg.allreduce vs rdt.allreduce, same run.

    Needs Ray initialized. Returns rows {"bench", "case", "size", "seconds"} (median of
    `repeat` warm runs; `cold` is the first call) and ratio rows against the imperative case.
    """
    sizes = sorted({s for s in sizes if s <= MAX_BYTES} | {MAX_BYTES})
    workers = [Worker.options(num_cpus=0).remote() for _ in range(ACTORS)]
    group = None
    rows: list[dict[str, Any]] = []
    try:
        host, port = ray.get(workers[0].host_store.remote())
        ray.get([w.join_raw.remote(r, ACTORS, host, port) for r, w in enumerate(workers)])
        group = rdt.create_collective_group(workers, name=f"bench-collectives-{time.monotonic_ns()}")
        for size in sizes:
            rows += _one_size(workers, size, max(repeat, 1))
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        for w in workers:
            ray.kill(w)
    return rows


def _one_size(workers: list[Any], size: int, repeat: int) -> list[dict[str, Any]]:
    numel = size // 4
    ray.get([w.fill.remote(numel) for w in workers])
    refs = [w.grad.remote(numel) for w in workers]
    ray.wait(refs, num_returns=len(refs))

    def imperative() -> None:
        ray.get([w.raw_allreduce.remote(numel) for w in workers])

    def imperative_copy() -> None:
        ray.get([w.raw_allreduce.remote(numel, True) for w in workers])

    def declarative() -> None:
        out = rdt.allreduce(refs)
        del out  # the results are freed: the next call reuses their buffers

    def inplace() -> None:
        rdt.allreduce(refs, inplace=True)

    cold = _timed(declarative)
    imperative()  # warm the raw group's connections for this size
    imperative_copy()  # and its result buffers
    times: dict[str, list[float]] = {
        "imperative pg.allreduce": [], "imperative copy + pg.allreduce": [],
        "rdt.allreduce": [], "rdt.allreduce inplace=True": [],
    }  # fmt: skip
    for _ in range(repeat):
        times["imperative pg.allreduce"].append(_timed(imperative))
        times["imperative copy + pg.allreduce"].append(_timed(imperative_copy))
        time.sleep(0.05)  # let the last results' anchors go (1-6 ms), so their buffers are reused
        times["rdt.allreduce"].append(_timed(declarative))
        times["rdt.allreduce inplace=True"].append(_timed(inplace))
    medians = {case: statistics.median(ts) for case, ts in times.items()}
    base = medians["imperative pg.allreduce"]
    rows = [_row(case, size, s) for case, s in medians.items()]
    rows.append(_row("rdt.allreduce cold", size, cold))
    for case in ("rdt.allreduce", "rdt.allreduce inplace=True"):
        rows.append({"bench": "collectives", "case": f"{case} / imperative", "size": size, "ratio": medians[case] / base})
    rows.append({"bench": "collectives", "case": "rdt.allreduce / imperative copy", "size": size,
                 "ratio": medians["rdt.allreduce"] / medians["imperative copy + pg.allreduce"]})
    return rows


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _row(case: str, size: int, seconds: float) -> dict[str, Any]:
    return {"bench": "collectives", "case": case, "size": size, "seconds": seconds, "GiB/s": size / seconds / (1 << 30)}
