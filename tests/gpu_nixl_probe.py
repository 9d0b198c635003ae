"""python tests/gpu_nixl_probe.py OUTDIR: which path UCX gives NIXL's READs on this GPU machine.

Raw NIXL READs (no rdt_async transport) between two processes on one GPU, GPU->GPU
and CPU->GPU, under several UCX settings and with the agents made before or after the
process's CUDA context, each pair in fresh processes (UCX reads its environment once per
context). Prints one line per case (GB/s, checksum
checked) and keeps each pair's UCX log (UCX_PROTO_INFO: the protocol and transport UCX
chose for each kind of memory) in OUTDIR. Part of tests/run_gpu.sh; needs CUDA and nixl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

GIB = 1 << 30
# name: (environment, how the agents are made: "cuda-first" (a CUDA context, then the
# agent), "agent-first" (the agent before any CUDA call), "rdt" (rdt_async's set-up, then the agent))
CONFIGS = {
    "ucx-auto,cuda-first": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}, "cuda-first"),
    "get-zcopy-on,cuda-first": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, "cuda-first"),
    "get-zcopy-on,agent-first": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, "agent-first"),
    "rdt-setup,agent-first": ({}, "rdt"),
}
CASES = [("cuda", "cuda", 4096), ("cuda", "cuda", 256 << 20), ("cpu", "cuda", 64 << 20)]
BUDGET_S = 2.0


def _agent(name: str) -> object:
    """A raw NIXL agent (UCX, no progress thread), made as PROBE_ORDER says."""
    import torch

    from rdt_async.bench import _rawnixl

    order = os.environ["PROBE_ORDER"]
    if order == "cuda-first":
        torch.cuda.synchronize()
    return _rawnixl.agent(name, rdt_settings=order == "rdt")


def _producer(conn: object) -> None:
    import torch

    from rdt_async.bench.gpu import _pattern

    agent = _agent(f"probe-producer-{os.getpid()}")
    held = {}
    for src, _, n in CASES:
        t = held[(src, n)] = _pattern(n, src, n)
        agent.register_memory(t)
    torch.cuda.synchronize()
    sums = {k: int(t.sum(dtype=torch.int64)) for k, t in held.items()}
    conn.send((agent.get_agent_metadata(), {k: t.data_ptr() for k, t in held.items()}, sums))
    while not conn.poll(0.001):
        agent.get_new_notifs()


def _consumer() -> None:
    import multiprocessing as mp

    import torch

    from rdt_async.bench import _rawnixl

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,), daemon=True)
    proc.start()
    md, addrs, sums = conn.recv()
    agent = _agent(f"probe-consumer-{os.getpid()}")
    remote = agent.add_remote_agent(md)
    mem = {"cuda": "VRAM", "cpu": "DRAM"}
    for src, dst, n in CASES:
        out = torch.empty(n, dtype=torch.uint8, device=dst)
        reg = agent.register_memory(out)
        rd = agent.get_xfer_descs([(addrs[(src, n)], n, 0)], mem[src])
        ld = agent.get_xfer_descs([(out.data_ptr(), n, 0)], mem[dst])
        row: dict[str, object] = {"case": f"{src}->{dst}", "size": n}
        try:
            times = []
            start = time.perf_counter()
            for i in range(8):
                t0 = time.perf_counter()
                _rawnixl.read(agent, ld, rd, remote)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
                if time.perf_counter() - start > BUDGET_S:
                    break
            times = times or [time.perf_counter() - start]
            s = sorted(times)[len(times) // 2]
            row |= {"ms": round(s * 1e3, 3), "gb_s": round(n / s / 1e9, 2), "reps": len(times)}
            row["ok"] = int(out.sum(dtype=torch.int64)) == sums[(src, n)]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        print("ROW " + json.dumps(row), flush=True)
        agent.deregister_memory(reg)
    conn.send("exit")
    proc.join(10)


def main(outdir: str) -> int:
    os.makedirs(outdir, exist_ok=True)
    results = {}
    for name, (env, order) in CONFIGS.items():
        log = os.path.join(outdir, f"probe-{name}.log")
        full = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        full |= env | {"PROBE_ORDER": order, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--consumer"], env=full, capture_output=True, text=True, timeout=40)
            text, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT", -1
        with open(log, "w") as f:
            f.write(text if isinstance(text, str) else text.decode())
        rows = [json.loads(line[4:]) for line in str(text).splitlines() if line.startswith("ROW ")]
        results[name] = {"env": env, "order": order, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
        for r in rows:
            print(f"{name:<22} {r['case']:<10} {r['size']:>11} {r.get('ms', '-'):>10} ms {r.get('gb_s', '-'):>8} GB/s ok={r.get('ok')} {r.get('error', '')}", flush=True)
        print(f"{name}: rc={rc} in {results[name]['seconds']} s", flush=True)
    with open(os.path.join(outdir, "probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--consumer"]:
        _consumer()
    else:
        raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
