"""python -m rdt_async.bench.gpu [--sizes 4K,...,4G] [--cross-sizes 4K,...,1G] [--json out.json]

GPU transfers between two processes on one GPU, no Ray (the GPU machine has none):
`cuda_ipc` and `nixl` fetches (fresh tensors, and `into=` buffers reused), beside the raw
paths a user could write instead (a CUDA IPC mapping and `copy_`, a raw NIXL READ) and
the physical limit (a device-to-device copy in one process); CPU->CUDA and CUDA->CPU
against a pinned `cudaMemcpy`. Every figure is wall-clock from the call until the bytes
have landed (device work synchronized), warm (connections made, memory mapped, one
untimed round first), the median of the repeats; each fetch row also gives the worst
stall of the consumer's event loop while it ran and the first (cold) fetch's time.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from . import _rawnixl
from ._report import write_json
from ._units import human, parse_size

GIB = float(1 << 30)


def _reps(n: int) -> int:
    return 30 if n <= 16 << 20 else 10 if n <= 1 << 30 else 5


def _pattern(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def _checksum(t: torch.Tensor) -> int:
    chunk = 64 << 20  # a sum makes an int64 temporary: keep it small
    return sum(int(t[i : i + chunk].sum(dtype=torch.int64)) for i in range(0, t.numel(), chunk))


def _producer_main(conn: Any, sizes: list[int], cross: list[int]) -> None:
    """Hold one CUDA tensor per size (and a CPU one per cross size); export them every way."""
    from rdt_async.transports import _registry
    from rdt_async.transports._base import TensorSpec, TransferInfo

    gpu = {n: _pattern(n, "cuda", n) for n in sizes}
    cpu = {n: _pattern(n, "cpu", n) for n in cross}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"sums": {("cuda", n): _checksum(t) for n, t in gpu.items()}}
    out["sums"].update({("cpu", n): _checksum(t) for n, t in cpu.items()})
    infos: dict[tuple[str, str, int], Any] = {}
    for name in ("cuda_ipc", "nixl"):
        transport = _registry.transport(name)
        for n, t in gpu.items():
            infos[(name, "cuda", n)] = TransferInfo(f"{name}-cuda-{n}", (TensorSpec.of(t),), transport.prepare(f"{name}-cuda-{n}", [t]))
        if name == "nixl":
            for n, t in cpu.items():
                infos[(name, "cpu", n)] = TransferInfo(f"nixl-cpu-{n}", (TensorSpec.of(t),), transport.prepare(f"nixl-cpu-{n}", [t]))
    out["infos"] = infos
    out["ipc"] = {n: t.untyped_storage()._share_cuda_() for n, t in gpu.items()}
    raw = _rawnixl.agent(f"bench-gpu-raw-producer-{os.getpid()}")
    for t in [*gpu.values(), *cpu.values()]:
        raw.register_memory(t)
    out["raw"] = (raw.get_agent_metadata(), {("cuda", n): t.data_ptr() for n, t in gpu.items()} | {("cpu", n): t.data_ptr() for n, t in cpu.items()})
    conn.send(out)
    while not conn.poll(0.001):
        raw.get_new_notifs()  # the passive side progresses for wire-up


def _row(case: str, n: int, times: list[float], **extra: Any) -> dict[str, Any]:
    s = statistics.median(times)
    row = {"case": case, "size": n, "seconds": s, "gb_s": n / s / 1e9, **extra}
    print(_line(row), file=sys.stderr, flush=True)  # progress: a long run shows as it goes
    return row


def _line(r: dict[str, Any]) -> str:
    extra = "".join(f"  {k}={r[k]:.3g}" for k in ("first_s", "first_map_s", "max_stall_ms") if k in r)
    return f"{r['case']:<52} {human(r['size']):>10} {r['seconds'] * 1e3:10.3f} ms {r['gb_s']:8.2f} GB/s{extra}"


BUDGET_S = 5.0  # a case stops repeating after this long (slow paths: a few samples)


def _timed(fn: Any, n: int) -> list[float]:
    times: list[float] = []
    start = time.perf_counter()
    for i in range(_reps(n) + 1):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        if len(times) >= 2 and time.perf_counter() - start > BUDGET_S:
            break
    return times


def _limits(sizes: list[int], cross: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), _pattern(n, "cuda", 1)
        rows.append(_row("limit: device-to-device copy_, one process", n, _timed(lambda: a.copy_(b), n)))
    for n in cross:
        host, dev = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device="cuda")
        host.fill_(1)
        rows.append(_row("limit: pinned CPU -> CUDA cudaMemcpy", n, _timed(lambda: dev.copy_(host, non_blocking=True), n)))
        rows.append(_row("limit: CUDA -> pinned CPU cudaMemcpy", n, _timed(lambda: host.copy_(dev, non_blocking=True), n)))
        pageable = torch.ones(n, dtype=torch.uint8)
        rows.append(_row("pageable CPU -> CUDA copy_", n, _timed(lambda: dev.copy_(pageable), n)))
        rows.append(_row("CUDA -> pageable CPU copy_", n, _timed(lambda: pageable.copy_(dev), n)))
    return rows


def _raw_ipc(shares: dict[int, Any], sums: dict[Any, int]) -> list[dict[str, Any]]:
    rows = []
    for n, (device, *share) in shares.items():
        t0 = time.perf_counter()
        storage = torch.UntypedStorage._new_shared_cuda(device, *share)
        mapped = time.perf_counter() - t0
        src = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)[:n]
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        rows.append(_row("raw CUDA IPC: mapped once, copy_", n, _timed(lambda: dst.copy_(src), n), first_map_s=mapped))
        side = torch.cuda.Stream()

        def on_side() -> None:  # as cuda_ipc copies: on a stream of its own, an event spun on
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            while not done.query():
                pass

        rows.append(_row("raw CUDA IPC: copy_ on a side stream, event spun", n, _timed(on_side, n)))
        assert _checksum(dst) == sums[("cuda", n)], f"raw IPC copy of {n} bytes differs"
    return rows


def _raw_nixl(raw: Any, sizes: list[int], cross: list[int], sums: dict[Any, int]) -> list[dict[str, Any]]:
    md, addrs = raw
    agent = _rawnixl.agent(f"bench-gpu-raw-consumer-{os.getpid()}")
    remote = agent.add_remote_agent(md)
    rows = []
    cases = [("cuda", "cuda", n) for n in sizes] + [("cpu", "cuda", n) for n in cross] + [("cuda", "cpu", n) for n in cross]
    for src_dev, dst_dev, n in cases:
        dst = torch.empty(n, dtype=torch.uint8, device=dst_dev)
        reg = agent.register_memory(dst)
        mem = {"cuda": "VRAM", "cpu": "DRAM"}
        remote_descs = agent.get_xfer_descs([(addrs[(src_dev, n)], n, 0)], mem[src_dev])
        local_descs = agent.get_xfer_descs([(dst.data_ptr(), n, 0)], mem[dst_dev])

        def read() -> None:
            _rawnixl.read(agent, local_descs, remote_descs, remote)

        rows.append(_row(f"raw NIXL READ {src_dev} -> {dst_dev}", n, _timed(read, n)))
        assert _checksum(dst) == sums[(src_dev, n)], f"raw NIXL READ of {n} bytes differs"
        agent.deregister_memory(reg)
        del dst
    return rows


async def _fetch_rows(
    infos: dict[Any, Any], sums: dict[Any, int], sizes: list[int], cross: list[int], transports: tuple[str, ...]
) -> list[dict[str, Any]]:
    from rdt_async.transports import _registry
    from rdt_async.transports._base import FetchRequest

    rows = []
    cases = [(name, "cuda", "cuda", n) for name in ("cuda_ipc", "nixl") for n in sizes]
    cases += [("nixl", "cpu", "cuda", n) for n in cross] + [(name, "cuda", "cpu", n) for name in ("nixl", "cuda_ipc") for n in cross]
    cases = [c for c in cases if c[0] in transports]
    for name, src_dev, dst_dev, n in cases:
        transport = _registry.transport(name)
        await asyncio.to_thread(transport.warm_up)
        info = infos[(name, src_dev, n)]
        kinds = ["fresh tensors", "into= (reused)"] if src_dev == dst_dev else ["into= (reused)"]
        if transport.registers_memory:
            kinds.append("into= (registered)")  # rdt.register_memory once, as the docs advise
        for kind in kinds:
            into = kind != "fresh tensors"
            buffers = [torch.empty(n, dtype=torch.uint8, device=dst_dev)] if into else None
            held = transport.register_memory(buffers) if buffers is not None and kind == "into= (registered)" else None
            times: list[float] = []
            out = None
            probe = _LagProbe()
            start = time.perf_counter()
            for i in range(_reps(n) + 1):
                if len(times) >= 2 and time.perf_counter() - start > BUDGET_S:
                    break
                out = None
                t0 = time.perf_counter()
                out = await FetchRequest.start(transport, info, buffers=buffers).wait()
                took = time.perf_counter() - t0
                if i == 0:
                    first = took
                    probe.start()  # the stall of warm fetches (the first may load libraries)
                else:
                    times.append(took)
            stall = await probe.stop()
            assert out is not None and out[0].device.type == dst_dev
            assert _checksum(out[0]) == sums[(src_dev, n)], f"{name} fetch of {n} bytes differs"
            rows.append(_row(f"rdt {name} fetch {src_dev} -> {dst_dev}, {kind}", n, times, first_s=first, max_stall_ms=stall * 1e3))
            if held is not None:
                transport.deregister_memory(held)
            del out, buffers
    return rows


async def _phases(name: str, infos: dict[Any, Any], sizes: list[int]) -> dict[str, Any]:
    """Where a warm fetch into reused buffers (registered, for a transport that registers
    memory) over `name` (cuda_ipc, nixl) spends its time:
    the median time from the call to each step's start ("... in") and end (ms), its parts
    timed in place (diagnostics)."""
    from rdt_async.transports import _registry, cuda_ipc
    from rdt_async.transports._base import FetchRequest

    marks: list[tuple[str, float]] = []

    def timed(owner: Any, attr: str, is_async: bool) -> Any:
        fn = getattr(owner, attr)

        async def awrapper(*a: Any, **k: Any) -> Any:
            marks.append((attr + " in", time.perf_counter()))
            try:
                return await fn(*a, **k)
            finally:
                marks.append((attr, time.perf_counter()))

        def wrapper(*a: Any, **k: Any) -> Any:
            marks.append((attr + " in", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((attr, time.perf_counter()))

        setattr(owner, attr, awrapper if is_async else wrapper)
        return fn

    if name == "cuda_ipc":
        patched = [
            (cuda_ipc.CudaIpcTransport, "_check_live", False),
            (cuda_ipc._Use, "mapped", True),
            (cuda_ipc.CudaIpcTransport, "_queue_and_wait", True),
            (cuda_ipc, "_wait_landed", True),
            (cuda_ipc, "_wait_copy", False),
        ]
    else:
        from rdt_async.transports.nixl import _memory, _peers, _plan, _transport, _xfer

        patched = [
            (_transport.NixlTransport, "_get_async", True),
            (_peers.Peers, "connect", True),
            (_plan.ReadPlan, "read", True),
            (_memory.Registrations, "register_all", True),
            (_plan, "post", True),
            (_xfer, "_poll_on_loop", True),
            (_xfer, "_poll_closely", False),
        ]
    saved = [(owner, attr, timed(owner, attr, is_async)) for owner, attr, is_async in patched]
    transport = _registry.transport(name)
    out: dict[str, Any] = {}
    try:
        for n in [n for n in sizes if n in (4096, 64 << 20, 1 << 30)]:
            info, buffers = infos[(name, "cuda", n)], [torch.empty(n, dtype=torch.uint8, device="cuda")]
            held = transport.register_memory(buffers) if transport.registers_memory else None  # as the docs advise
            runs: list[dict[str, float]] = []
            for i in range(12):
                marks.clear()
                t0 = time.perf_counter()
                await FetchRequest.start(transport, info, buffers=buffers).wait()
                end = time.perf_counter()
                if i:
                    run: dict[str, float] = {}
                    for step, t in marks:
                        run.setdefault(step, (t - t0) * 1e3)  # the first of each (a fetch checks liveness twice)
                    run["returned"] = (end - t0) * 1e3
                    runs.append(run)
            if held is not None:
                transport.deregister_memory(held)
            steps = sorted({k for r in runs for k in r}, key=lambda k: statistics.median(r.get(k, 0) for r in runs))
            out[human(n)] = {k: round(statistics.median(r[k] for r in runs if k in r), 3) for k in steps}
            print(f"{name} phases {human(n)} (ms from the call): {out[human(n)]}", file=sys.stderr, flush=True)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    if name == "cuda_ipc" and ("cuda_ipc", "cuda", 4096) in infos:
        out["parts_us"] = await _ipc_parts(infos[("cuda_ipc", "cuda", 4096)])
        print(f"cuda_ipc parts (us, median): {out['parts_us']}", file=sys.stderr, flush=True)
    return out


async def _ipc_parts(info: Any) -> dict[str, float]:
    """What each step of queueing a 4 KiB cuda_ipc copy costs on this thread (µs, median of 50)."""
    from rdt_async._local import pid_alive
    from rdt_async.transports import _registry, cuda_ipc

    transport = _registry.transport("cuda_ipc")
    dst = torch.empty(4096, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def us(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return round(statistics.median(times) * 1e6, 1)

    def queued() -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    def in_ctx() -> None:
        with torch.cuda.stream(side):
            pass

    def recorded() -> None:
        torch.cuda.Event().record(side)

    with cuda_ipc._mappings.using([info.meta.tensors[0]]) as use:
        await use.mapped()
        src = use.sources[0]
        return {
            "_checked": us(lambda: cuda_ipc._checked(info)),
            "_check_live": us(lambda: transport._check_live(info)),
            "pid_alive": us(lambda: pid_alive(info.meta.pid)),
            "_wrap": us(lambda: cuda_ipc._wrap(src.data_ptr(), 4096, 0)),
            "current_stream": us(lambda: torch.cuda.current_stream(dst.device)),
            "wait_stream": us(lambda: side.wait_stream(torch.cuda.current_stream(dst.device))),
            "stream ctx": us(in_ctx),
            "ctx+copy_": us(queued),
            "Event()+record": us(recorded),
            "Event(timing)+record": us(lambda: torch.cuda.Event(enable_timing=True).record(side)),
            "query": us(lambda: torch.cuda.Event().query()),
        }


class _LagProbe:
    """How late the loop wakes a 1 ms sleeper while transfers run (a blocked loop shows)."""

    def __init__(self) -> None:
        self.lag = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lag = max(self.lag, time.perf_counter() - t0 - 0.001)

    async def stop(self) -> float:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return self.lag


def checks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU issue's targets, as ratios against the raw copy of the same kind in this run:
    time ratios, ours over theirs (below 1: ours faster)."""
    by = {(r["case"], r["size"]): r for r in rows}
    out: dict[str, Any] = {}
    pairs = [
        ("rdt cuda_ipc fetch cuda -> cuda, into= (reused)", "raw CUDA IPC: mapped once, copy_"),
        ("rdt cuda_ipc fetch cuda -> cuda, fresh tensors", "raw CUDA IPC: mapped once, copy_"),
        ("rdt nixl fetch cuda -> cuda, into= (reused)", "raw NIXL READ cuda -> cuda"),
        ("rdt nixl fetch cuda -> cuda, into= (registered)", "raw NIXL READ cuda -> cuda"),
        ("rdt nixl fetch cuda -> cuda, into= (reused)", "limit: device-to-device copy_, one process"),
        ("rdt nixl fetch cpu -> cuda, into= (reused)", "raw NIXL READ cpu -> cuda"),
        ("rdt nixl fetch cpu -> cuda, into= (reused)", "pageable CPU -> CUDA copy_"),
        ("rdt nixl fetch cpu -> cuda, into= (reused)", "limit: pinned CPU -> CUDA cudaMemcpy"),
        ("rdt nixl fetch cuda -> cpu, into= (reused)", "raw NIXL READ cuda -> cpu"),
        ("rdt nixl fetch cuda -> cpu, into= (reused)", "CUDA -> pageable CPU copy_"),
        ("rdt cuda_ipc fetch cuda -> cpu, into= (reused)", "CUDA -> pageable CPU copy_"),
    ]
    for case, raw in pairs:
        ratios = {
            human(s): round(by[(raw, s)]["gb_s"] / r["gb_s"], 3)
            for (c, s), r in by.items()
            if c == case and (raw, s) in by and s >= 64 << 20
        }
        if ratios:
            out[f"{case} / {raw} (>= 64 MiB)"] = ratios
    stalls = [r["max_stall_ms"] for r in rows if "max_stall_ms" in r]
    if stalls:
        out["worst_loop_stall_ms"] = round(max(stalls), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rdt_async.bench.gpu", description=__doc__)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M,1G,4G")
    ap.add_argument("--cross-sizes", default="4K,1M,64M,256M")
    ap.add_argument("--transports", default="cuda_ipc,nixl", help="fetch rows for these transports")
    ap.add_argument("--json", default="-", help="file for the JSON results ('-': stdout)")
    args = ap.parse_args(argv)
    transports = tuple(args.transports.split(","))
    if not torch.cuda.is_available():
        print("python -m rdt_async.bench.gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cross = [parse_size(s) for s in args.cross_sizes.split(",") if s]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(child, sizes, cross), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        got = conn.recv()
        stages: tuple[Callable[[], list[dict[str, Any]]], ...] = (
            lambda: _limits(sizes, cross),
            lambda: _raw_ipc(got["ipc"], got["sums"]),
            lambda: asyncio.run(_fetch_rows(got["infos"], got["sums"], sizes, cross, transports)),
            lambda: _raw_nixl(got["raw"], sizes, cross, got["sums"]) if "nixl" in transports else [],
        )
        for stage in stages:
            rows += stage()
            torch.cuda.empty_cache()
        phases: dict[str, Any] = {}
        for name in transports:
            try:
                phases[name] = asyncio.run(_phases(name, got["infos"], sizes))
            except Exception as exc:  # diagnostics: never the run's end
                phases[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.send("exit")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "rows": rows,
        "phases_ms": phases,
        "checks": checks(rows),
    }
    out = write_json(result, args.json)
    for r in rows:
        print(_line(r), file=out)
    for k, v in result["checks"].items():
        print(f"check: {k} = {v}", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
