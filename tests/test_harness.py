"""The suite's own tools, which its verdicts rest on: the loop-lag probe must see a loop
that is held and must not blame the code for a loop whose thread only waited for a core;
test hosts of sessions that start at once (pytest-xdist's workers) never share a network."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from probes import LagProbe

from rdt_async.bench import _hosts

# A real-time process that spins on one core: a thread of ours pinned there gets no time at
# all until it exits (the kernel's throttle leaves others 50 ms a second, past 0.3 s).
HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
print("spinning", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


def _probed(body) -> LagProbe:
    async def main() -> LagProbe:
        probe = LagProbe()
        probe.start()
        await asyncio.sleep(0.05)
        await body()
        await asyncio.sleep(0.05)
        await probe.stop()
        return probe

    return asyncio.run(main())


def test_a_loop_held_by_a_blocking_call_is_reported_with_the_call():
    async def held():
        time.sleep(0.2)  # on the loop's thread: nothing else runs meanwhile

    probe = _probed(held)
    assert 0.18 < probe.max_lag < 1.0, probe.report()
    assert probe.waited < 0.05, probe.report()
    assert "time.sleep(0.2)" in probe.culprit, probe.report()


def test_a_loop_whose_thread_waits_for_a_core_is_not_blamed_for_it():
    """A test worker beside this one can keep a core from the loop; that is not the code's stall."""
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread, the loop's, shares one core with the hog

    async def starved():
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpu), "0.3"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        # Read its word on a thread of another core: the loop's thread must stay free to starve.
        os_line = await asyncio.to_thread(hog.stdout.readline)
        if os_line != "spinning\n":
            hog.wait()
            pytest.skip(f"no real-time priority here (it takes root): {hog.stderr.read().strip()[-200:]}")
        while hog.poll() is None:
            await asyncio.sleep(0.01)
        hog.stdout.close(), hog.stderr.close()

    try:
        probe = _probed(starved)
    finally:
        os.sched_setaffinity(0, before)
    assert probe.max_late > 0.2, probe.report()  # the wake-ups were late, as the user of that loop saw
    assert probe.max_lag < 0.05, probe.report()  # but nothing of ours held the loop


CLAIM = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("_hosts", sys.argv[3])  # stdlib only: no torch, no Ray to import
_hosts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_hosts)
claim = _hosts._KeyClaim.take(int(sys.argv[1]))
print("taken" if claim else "refused", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _claim_elsewhere(key: int, hold: float) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CLAIM, str(key), str(hold), _hosts.__file__], stdout=subprocess.PIPE, text=True)
    p.word = p.stdout.readline().strip()  # type: ignore[attr-defined]
    return p


@pytest.mark.skipif(not os.access("/run", os.W_OK), reason="test hosts claim their keys under /run (root)")
def test_a_network_key_is_held_by_one_process_until_it_lets_go_or_dies():
    key = 219  # the top of the range: a session's own pick starts from its pid
    claim = _hosts._KeyClaim.take(key)
    assert claim is not None, "another session holds key 219"
    path = f"/run/rdt-hosts-{key}.lock"
    try:
        other = _claim_elsewhere(key, 0)
        assert (other.word, other.wait()) == ("refused", 0)
        assert _hosts._KeyClaim.take(key) is None  # not even twice in one process (flock is per open file)
    finally:
        claim.release()
    assert not os.path.exists(path)  # nothing left under /run
    holder = _claim_elsewhere(key, 60)
    try:
        assert holder.word == "taken" and _hosts._KeyClaim.take(key) is None
    finally:
        holder.kill()
        holder.wait()
    again = _hosts._KeyClaim.take(key)  # a killed holder's claim ended with it
    assert again is not None
    again.release()
    assert not os.path.exists(path)
