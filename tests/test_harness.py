"""The suite's own tools, which its verdicts rest on: the loop-lag probe must see a loop
that is held, and must not blame the code for a loop that waited only because the machine
gave no core to its thread or to the thread holding the GIL; test hosts of sessions that
start at once (pytest-xdist's workers) never share a network."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from probes import LagProbe

from rdt_async.bench import _hosts

# A real-time process that spins on one core for `seconds` once it says "spinning" (with
# "1" after them: once it gets SIGUSR1, or 10 s on): a thread of ours pinned there gets no
# time meanwhile but what Linux's fair server leaves others (~50 ms a second).
HOG = """
import os, signal, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("spinning", flush=True)
if sys.argv[3] == "1":
    signal.sigtimedwait({signal.SIGUSR1}, 10)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


async def _hogged(cpu: int, seconds: float = 0.3, ready: Callable[[int], None] | None = None) -> None:
    """Run the hog on `cpu` for `seconds` (`ready(pid)`: it spins once sent SIGUSR1); skip
    where real-time priority is not ours to take."""
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpu), str(seconds), "1" if ready else "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with hog:
        word = await asyncio.to_thread(hog.stdout.readline)  # (off the loop's thread: it must be free to starve)
        if word != "spinning\n":
            hog.wait()
            pytest.skip(f"no real-time priority here (it takes root): {hog.stderr.read().strip()[-200:]}")
        if ready is not None:
            ready(hog.pid)
        while hog.poll() is None:
            await asyncio.sleep(0.01)


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
    assert 0.15 < probe.max_lag < 1.0, probe.report()  # (under load: less what other threads waited)
    assert probe.max_late - probe.max_lag < 0.05, probe.report()  # nothing excused
    assert "time.sleep(0.2)" in probe.culprit, probe.report()


def _numbers_for(seconds: float) -> int:
    """How many numbers `sum(range(n))` adds in about `seconds` of a core here."""
    t0 = time.thread_time()
    sum(range(1_000_000))
    return int(1_000_000 * seconds / max(time.thread_time() - t0, 1e-4))


def test_a_loop_kept_from_the_gil_by_a_thread_of_ours_is_blamed():
    """A thread that keeps the GIL while it runs (one C call of ~0.4 s, no switch)."""
    done, finish, n = [], threading.Event(), _numbers_for(0.4)

    def hold() -> None:
        done.append(sum(range(n)))
        finish.wait()  # (alive until the probe has read what it ran)

    async def held():
        thread = threading.Thread(target=hold)
        thread.start()
        while not done:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        finish.set()
        await asyncio.to_thread(thread.join)

    probe = _probed(held)
    assert done == [sum(range(n))]
    assert probe.worst_ran > 0.15, probe.report()  # the holder's run (~0.4 s of a core), seen
    # and blamed (under load, the time it waited for a core is not). The kernel's counters
    # are read over the wake-up's window, not the holder's hold: a holder that waited for a
    # core before it took the GIL is excused a little too much (seen with 4 busy processes
    # beside the test: 253 ms blamed of a 380 ms run, 1.9 s late), so half the run at least;
    # where the holder waited longer for a core than it ran (a machine run far past its
    # cores: 753 ms of waits beside a 389 ms run), the counters cannot tell the two apart.
    overloaded = probe.max_excused > probe.worst_ran
    assert overloaded or probe.max_lag > 0.5 * min(probe.max_late, probe.worst_ran), probe.report()


def test_a_loop_whose_thread_waits_for_a_core_is_not_blamed_for_it():
    """A test worker beside this one can keep a core from the loop; that is not the code's stall."""
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread, the loop's, shares one core with the hog

    async def starved():
        await _hogged(cpu)

    try:
        probe = _probed(starved)
    finally:
        os.sched_setaffinity(0, before)
    assert probe.max_late > 0.2, probe.report()  # the wake-ups were late, as the user of that loop saw
    assert probe.max_lag < 0.05, probe.report()  # but nothing of ours held the loop


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: the loop's, and one to starve")
def test_a_loop_waiting_for_the_gil_of_a_thread_that_waits_for_a_core_is_not_blamed_for_it():
    """A thread of ours wakes a hog on its own core and keeps the GIL through a C call
    (~0.2 s of a core's time): preempted by the hog for 0.5 s, it holds the GIL, and the
    loop waits on it. The time the holder ran is the code's; the time it waited is not."""
    # The scene needs the machine's cores as arranged; another test process running at
    # once (a CI worker beside this one) can break it up: it is set up anew up to 3 times,
    # and all its claims must hold in one of them.
    reports = []
    for _ in range(3):
        failed = _gil_waits_for_a_core_once()
        if failed is None:
            return
        reports.append(failed)
    pytest.fail("\n".join(reports))


def _gil_waits_for_a_core_once() -> str | None:
    """One run of the scene above: None if every claim held, else which did not and the probe's report."""
    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})  # the loop's thread: a core of its own
    hog, finish, done = queue.Queue(), threading.Event(), []
    n = _numbers_for(0.2)

    def call() -> None:
        os.sched_setaffinity(0, {cpus[-1]})
        pid = hog.get()
        os.kill(pid, signal.SIGUSR1)  # (keeps the GIL): the hog takes this core at once
        done.append(sum(range(n)))  # one C call: the GIL stays with it, running or not
        finish.wait()  # a pool's thread stays: the probe reads what it waited once the loop runs

    async def starved():
        caller = threading.Thread(target=call)
        caller.start()
        await _hogged(cpus[-1], 0.5, hog.put)
        finish.set()
        await asyncio.to_thread(caller.join)

    try:
        probe = _probed(starved)
    finally:
        os.sched_setaffinity(0, before)
    assert done == [sum(range(n))]
    claims = {
        "max_late > 0.45 (the loop waited all along)": probe.max_late > 0.45,
        # but is blamed for no more than the holder ran (~0.2 s), and its 0.5 s wait is
        # excused (a loaded machine may split the wait and the run into two wake-ups)
        "max_lag < worst_ran + 0.1": probe.max_lag < probe.worst_ran + 0.1,
        "max_excused > 0.4": probe.max_excused > 0.4,
    }
    broken = [c for c, held in claims.items() if not held]
    return f"{', '.join(broken)}: {probe.report()}" if broken else None


CLAIM = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("_hosts", sys.argv[3])  # stdlib only: no torch, no Ray to import
_hosts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_hosts)
claim = _hosts._KeyClaim.take(int(sys.argv[1]))
print("taken" if claim else "refused", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _claim_elsewhere(key: int, hold: float) -> tuple[subprocess.Popen[str], str]:
    """A process that tries to take `key` and holds what it got for `hold` s; what it said."""
    p = subprocess.Popen([sys.executable, "-c", CLAIM, str(key), str(hold), _hosts.__file__], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


@pytest.mark.skipif(not os.access("/run", os.W_OK), reason="test hosts claim their keys under /run (root)")
def test_a_network_key_is_held_by_one_process_until_it_lets_go_or_dies():
    # The free key nearest the top of the range: a session's own pick starts from its pid
    # (219 itself was once this run's own cluster's, by chance).
    claim = next(filter(None, (_hosts._KeyClaim.take(k) for k in range(219, 19, -1))), None)
    assert claim is not None, "every key is held"
    key = claim.key
    path = f"/run/rdt-hosts-{key}.lock"
    try:
        other, word = _claim_elsewhere(key, 0)
        with other:
            assert (word, other.wait()) == ("refused", 0)
        assert _hosts._KeyClaim.take(key) is None  # not even twice in one process (flock is per open file)
    finally:
        claim.release()
    assert not os.path.exists(path)  # nothing left under /run
    holder, word = _claim_elsewhere(key, 60)
    with holder:
        try:
            assert word == "taken" and _hosts._KeyClaim.take(key) is None
        finally:
            holder.kill()
    again = _hosts._KeyClaim.take(key)  # a killed holder's claim ended with it
    assert again is not None
    again.release()
    assert not os.path.exists(path)
