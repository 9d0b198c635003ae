"""rdt_async lives through the process's Ray lifecycle: ray.shutdown(), ray.init(), exit.

Each case is a fresh Python process, a driver of its own that joins the session's cluster
(ray.init(address=...), ray.shutdown() ends only its connection): a local Ray of its own
for each would cost a whole Ray start (~10 CPU-s) and tell nothing more. Had anything
started Ray again after the shutdown, it would be a local instance that says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

RESTARTS = textwrap.dedent(
    """
    import asyncio, gc, time, torch, ray
    import rdt_async as rdt

    @rdt.remote
    class Consumer:
        async def total(self, value):
            return float(value["w"].sum())

    for session in range(2):
        ray.init(address=ADDRESS, log_to_driver=False)
        fill = float(session + 1)
        refs = [rdt.put({"w": torch.full((1 << 15,), fill)}) for _ in range(40)]  # kept: past the anchor pool
        big = rdt.put({"w": torch.full((1 << 19,), fill)})  # 2 MiB: over shm
        c = Consumer.remote()
        remote = ray.get([c.total.remote(refs[0]), c.total.remote(big)], timeout=60)
        here = asyncio.run(rdt.fetch(refs[-1]))["w"][0].item()
        held = rdt.store_stats()["objects"]
        del refs, big
        gc.collect()
        deadline = time.monotonic() + 20
        while rdt.store_stats()["objects"] and time.monotonic() < deadline:
            time.sleep(0.05)  # freed by Ray's out-of-scope callbacks of this session
        print("session", session, remote, here, held, rdt.store_stats()["objects"], flush=True)
        leftover = rdt.put({"w": torch.ones(1 << 15)})  # kept (not inline), left when Ray goes away
        ray.shutdown()
    print("after", rdt.store_stats()["objects"], ray.is_initialized(), flush=True)
    """
)

PUT_THEN_EXIT = textwrap.dedent(
    """
    import torch, ray
    import rdt_async as rdt
    ray.init(address=ADDRESS, log_to_driver=False)
    refs = [rdt.put({"w": torch.ones(10)}) for _ in range(30)]  # the pool refills in the background
    ray.shutdown()
    """
)


def _start(code: str, address: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # nothing but the code names a cluster
    env["PYTHONWARNINGS"] = "ignore::UserWarning"
    code = f"ADDRESS = {address!r}\n{code}"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_put_get_fetch_and_actors_work_after_shutdown_and_init(cluster):
    out = _finish(_start(RESTARTS, cluster.address))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("session", "after"))]
    assert out.returncode == 0, out.stderr[-3000:]
    assert lines == [
        "session 0 [32768.0, 524288.0] 1.0 41 0",  # the leftover of no session yet
        "session 1 [65536.0, 1048576.0] 2.0 41 0",  # session 0's leftover was freed at this init
        "after 1 False",  # Ray tells no one of a shutdown: the last leftover goes at exit
    ], out.stdout
    assert out.stderr.count("Connected to Ray cluster") == 2, out.stderr[-3000:]
    assert "Started a local Ray instance" not in out.stderr, out.stderr[-3000:]


def test_nothing_starts_ray_again_after_shutdown_at_exit(cluster):
    # Three processes at once: the refill races the exit in each.
    for out in [_finish(p) for p in [_start(PUT_THEN_EXIT, cluster.address) for _ in range(3)]]:
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stderr.count("Connected to Ray cluster") == 1, out.stderr[-3000:]
        assert "Started a local Ray instance" not in out.stderr, out.stderr[-3000:]
