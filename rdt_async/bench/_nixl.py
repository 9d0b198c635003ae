"""NIXL benchmarks: raw NIXL READ, our nixl transport, rdt.fetch over nixl, Ray's own NIXL RDT.

All figures are warm (buffers allocated and touched before timing, connections made,
one untimed round first) unless the case says otherwise; each row is the median of
`repeat` rounds. Raw NIXL and the transport run between two plain processes (no Ray);
`rdt.fetch` and Ray's RDT run between actors and the driver of the running Ray session.
Importing this module fails when nixl is not installed (the caller skips it). Each check
row's `ratio` is a time ratio, ours over theirs: below 1, ours is faster.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import nixl  # noqa: F401  (ImportError here: the caller skips NIXL benchmarks)
import ray
import torch

import rdt_async as rdt

from ..transports._base import FetchRequest
from . import _rawnixl

GIB = float(1 << 30)


def _cpu_seconds() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _producer_main(conn: Any, sizes: list[int]) -> None:
    """Hold one tensor per size, registered with a raw agent and prepared by the transport."""
    from rdt_async.transports import _registry
    from rdt_async.transports._base import TensorSpec, TransferInfo

    raw = _rawnixl.agent(f"bench-raw-producer-{os.getpid()}")
    tensors = {n: torch.full((n,), n % 251, dtype=torch.uint8) for n in sizes}
    for t in tensors.values():
        raw.register_memory(t)
    transport = _registry.transport("nixl")
    infos = {}
    for n, t in tensors.items():
        obj_id = f"bench-{n}"
        infos[n] = TransferInfo(obj_id, (TensorSpec.of(t),), transport.prepare(obj_id, [t]))
    conn.send((raw.get_agent_metadata(), {n: t.data_ptr() for n, t in tensors.items()}, infos))
    while True:
        if not conn.poll(0.001):
            raw.get_new_notifs()  # the passive side must progress for wire-up
            continue
        msg = conn.recv()
        if msg == "idle":  # CPU of this process over 1 s, raw agent quiet, transport agent idle
            t0 = _cpu_seconds()
            time.sleep(1.0)
            conn.send(_cpu_seconds() - t0)
        else:
            break


def _row(bench: str, case: str, size: int, times: list[float]) -> dict[str, Any]:
    s = statistics.median(times)
    return {"bench": bench, "case": case, "size": size, "seconds": s, "gib_s": size / s / GIB}


def _raw_read_rows(agent: Any, remote: str, addrs: dict[int, int], sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        dst = torch.zeros(n, dtype=torch.uint8)
        agent.register_memory(dst)
        remote_descs = agent.get_xfer_descs([(addrs[n], n, 0)], "DRAM")
        times = []
        for i in range(_reps(n, repeat) + 1):
            t0 = time.perf_counter()
            _rawnixl.read(agent, agent.get_xfer_descs(dst), remote_descs, remote)
            if i:
                times.append(time.perf_counter() - t0)
        assert int(dst[-1]) == n % 251
        rows.append(_row("nixl", "raw NIXL READ (2 processes, no Ray)", n, times))
        del dst
    return rows


def _transport_rows(infos: dict[int, Any], sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    from rdt_async.transports import _registry

    transport = _registry.transport("nixl")
    rows = []
    for n in sizes:
        dst = torch.zeros(n, dtype=torch.uint8)
        for into, case in ((True, "rdt nixl transport, into= (2 processes)"),
                           (False, "rdt nixl transport, fresh tensors (cold pages)")):
            times = []
            for i in range(_reps(n, repeat) + 1):
                t0 = time.perf_counter()
                out = FetchRequest.start(transport, infos[n], buffers=[dst] if into else None).result()
                if i:
                    times.append(time.perf_counter() - t0)
            assert int(out[0][-1]) == n % 251
            rows.append(_row("nixl", case, n, times))
            del out
    return rows


@rdt.remote
class _RdtProducer:
    def __init__(self, sizes: list[int]) -> None:
        self.t = {n: torch.full((n,), 7, dtype=torch.uint8) for n in sizes}

    @rdt.method(tensor_transport="nixl")
    def nixl(self, n: int) -> torch.Tensor:
        return self.t[n]

    def plain(self, n: int) -> torch.Tensor:
        return self.t[n]

    def put(self, n: int) -> list[Any]:
        return [ray.put(self.t[n])]  # a ref the driver borrows: its get asks this actor

    def holding_ref(self, n: int) -> tuple[torch.Tensor, Any]:
        return self.t[n], self.anchor  # a value holding an ObjectRef, as every RDTObject does

    def make_anchor(self) -> None:
        self.anchor = ray.put(None)


@ray.remote
class _RayProducer:
    def __init__(self, sizes: list[int]) -> None:
        self.t = {n: torch.full((n,), 9, dtype=torch.uint8) for n in sizes}

    @ray.method(tensor_transport="nixl")
    def make(self, n: int) -> torch.Tensor:
        return self.t[n]


@ray.remote(enable_tensor_transport=True)
class _RayConsumer:
    def take(self, t: torch.Tensor) -> int:
        return int(t[-1])


def _rdt_rows(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """rdt.fetch over nixl from an actor to the driver; Ray's object store for 4 KB."""
    p = _RdtProducer.remote(sizes)
    rows = []
    try:
        for n in sizes:
            dst = torch.zeros(n, dtype=torch.uint8)
            fetch_t, call_t = [], []
            for i in range(_reps(n, repeat) + 1):
                t0 = time.perf_counter()
                ref = p.nixl.remote(n)
                obj = ray.get(ref)
                t1 = time.perf_counter()
                out = rdt.get(obj, into=dst)
                t2 = time.perf_counter()
                assert int(out[-1]) == 7
                del ref, obj
                if i:
                    fetch_t.append(t2 - t1)
                    call_t.append(t2 - t0)
            rows.append(_row("nixl", "rdt.get nixl, into= (actor -> driver)", n, fetch_t))
            rows.append(_row("nixl", "rdt call + get nixl, into= (actor -> driver)", n, call_t))
            if n <= 1 << 20:
                rows += _object_store_rows(p, n, repeat)
    finally:
        ray.kill(p)
    return rows


def _reps(n: int, repeat: int) -> int:
    """Sub-millisecond cases get enough samples for a stable median."""
    return repeat if n > 1 << 20 else max(repeat, 200)


def _object_store_rows(p: Any, n: int, repeat: int) -> list[dict[str, Any]]:
    """Ray's object store for the same bytes: a call + get, and a get of a ready ref.

    Each case runs in a loop of its own, like the rdt rows: interleaved, each would pay
    for the reference counting the others leave behind.
    """
    ray.get(p.make_anchor.remote())

    def call_get() -> float:
        t0 = time.perf_counter()
        assert int(ray.get(p.plain.remote(n))[-1]) == 7
        return time.perf_counter() - t0

    def put_call_get() -> float:
        t0 = time.perf_counter()
        inner = ray.get(p.put.remote(n))[0]
        assert int(ray.get(inner)[-1]) == 7
        return time.perf_counter() - t0

    def ready_get() -> float:
        inner = ray.get(p.put.remote(n))[0]
        t0 = time.perf_counter()
        assert int(ray.get(inner)[-1]) == 7
        return time.perf_counter() - t0

    def holding() -> float:
        t0 = time.perf_counter()
        value, _ = ray.get(p.holding_ref.remote(n))
        took = time.perf_counter() - t0
        assert int(value[-1]) == 7
        return took

    reps = _reps(n, repeat)
    return [
        _row("nixl", "ray call + get of an inline return, no object store (baseline)", n, [call_get() for _ in range(reps + 1)][1:]),
        _row("nixl", "ray object store pass: call that ray.puts + get (baseline)", n,
             [put_call_get() for _ in range(reps + 1)][1:]),
        _row("nixl", "ray.get of a ready object-store ref the actor put (baseline)", n,
             [ready_get() for _ in range(reps + 1)][1:]),
        _row("nixl", "ray call + get of a value holding an ObjectRef (an RDT method's floor)", n,
             [holding() for _ in range(reps + 1)][1:]),
    ]


def _ray_rdt_rows(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """Ray 2.60's own NIXL RDT: actor -> actor argument, warm tensor on the producer."""
    p, c = _RayProducer.remote(sizes), _RayConsumer.remote()
    rows = []
    try:
        for n in sizes:
            times = []
            for i in range(repeat + 1):
                ref = p.make.remote(n)
                ray.wait([ref])
                t0 = time.perf_counter()
                assert ray.get(c.take.remote(ref), timeout=120) == 9
                if i:
                    times.append(time.perf_counter() - t0)
                del ref
            rows.append(_row("nixl", "ray RDT nixl (actor -> actor arg)", n, times))
    finally:
        ray.kill(p)
        ray.kill(c)
    return rows


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """Measure NIXL reads for each size (4 KB and 256 MB always); return one row per case.

    Needs a running Ray session for the rdt.fetch and Ray RDT rows.
    """
    sizes = sorted(set(sizes) | {4 << 10, 256 << 20})
    repeat = max(1, repeat)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(child, sizes), daemon=True)
    proc.start()
    child.close()
    rows: list[dict[str, Any]] = []
    try:
        md, addrs, infos = conn.recv()
        raw = _rawnixl.agent(f"bench-raw-consumer-{os.getpid()}")
        remote = raw.add_remote_agent(md)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        rows += _raw_read_rows(raw, remote, addrs, sizes, repeat)
        rows += _transport_rows(infos, sizes, repeat)
        conn.send("idle")
        rows.append({"bench": "nixl", "case": "idle producer CPU s per s (objects registered)", "size": 0,
                     "seconds": conn.recv(), "gib_s": 0.0})
    finally:
        try:
            conn.send("exit")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if ray.is_initialized():
        rows += _rdt_rows(sizes, repeat)
        try:
            rows += _ray_rdt_rows(sizes, repeat)
        except Exception as exc:  # Ray's RDT is alpha: report, do not fail the run
            rows.append({"bench": "nixl", "case": f"ray RDT nixl failed: {type(exc).__name__}: {exc}"[:120],
                         "size": 0, "seconds": float("nan"), "gib_s": 0.0})
    rows += _summary(rows)
    return rows


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["case"], r["size"]): r for r in rows}
    out = []
    n = 256 << 20
    raw = by.get(("raw NIXL READ (2 processes, no Ray)", n))
    ours = by.get(("rdt nixl transport, into= (2 processes)", n))
    full = by.get(("rdt.get nixl, into= (actor -> driver)", n))
    ray_rdt = by.get(("ray RDT nixl (actor -> actor arg)", n))
    if raw and ours:
        out.append({"bench": "nixl", "case": "check: 256M transport time / raw (target <= 1.25)", "size": n,
                    "seconds": 0.0, "gib_s": 0.0, "ratio": round(raw["gib_s"] / ours["gib_s"], 3)})
    if full and ray_rdt:
        out.append({"bench": "nixl", "case": "check: 256M rdt.get time / ray RDT (target <= 0.333)", "size": n,
                    "seconds": 0.0, "gib_s": 0.0, "ratio": round(ray_rdt["gib_s"] / full["gib_s"], 3)})
    for ours_case, ray_case, check in [
        ("rdt.get nixl, into= (actor -> driver)", "ray.get of a ready object-store ref the actor put (baseline)",
         "check: 4K nixl fetch / object-store get, ready refs (target <= 1)"),
        ("rdt call + get nixl, into= (actor -> driver)", "ray object store pass: call that ray.puts + get (baseline)",
         "check: 4K nixl call+get / object-store pass, call that puts + get (target <= 1)"),
        ("rdt call + get nixl, into= (actor -> driver)", "ray call + get of an inline return, no object store (baseline)",
         "4K nixl call+get / ray call + get of an inline return"),
        ("ray call + get of a value holding an ObjectRef (an RDT method's floor)", "ray call + get of an inline return, no object store (baseline)",
         "floor: 4K call+get of a value holding an ObjectRef / ray call + get of an inline return"),
    ]:
        ours, theirs = by.get((ours_case, 4096)), by.get((ray_case, 4096))
        if ours and theirs:
            out.append({"bench": "nixl", "case": check, "size": 4096,
                        "seconds": 0.0, "gib_s": 0.0, "ratio": round(ours["seconds"] / theirs["seconds"], 3)})
    return out
