"""The I/O loop's cancel-safe waits, without Ray: cleanup that must finish does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import rdt_async as rdt
from rdt_async import _io
from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo


async def _cancel_soon(task: asyncio.Task, times: int) -> None:
    for _ in range(times):
        await asyncio.sleep(0.01)
        task.cancel()


async def test_shielded_waits_through_every_cancel_and_says_it_was_cancelled():
    ended = asyncio.Event()

    async def cleanup():
        await asyncio.sleep(0.1)
        ended.set()
        return 7

    work = asyncio.ensure_future(cleanup())
    caller = asyncio.ensure_future(_io.shielded(work))
    await _cancel_soon(caller, 3)  # three cancels while the cleanup runs
    assert await caller is True
    assert ended.is_set() and work.result() == 7


async def test_shielded_without_a_cancel_says_so_and_leaves_errors_to_the_caller():
    async def fails():
        raise ValueError("boom")

    work = asyncio.ensure_future(fails())
    assert await _io.shielded(work) is False
    with pytest.raises(ValueError, match="boom"):
        work.result()


async def test_shielded_gives_up_at_its_timeout_and_the_work_goes_on():
    work = asyncio.ensure_future(asyncio.sleep(0.3, "late"))
    began = time.monotonic()
    assert await _io.shielded(work, timeout=0.05) is False
    assert 0.04 < time.monotonic() - began < 0.25 and not work.done()
    assert await work == "late"


async def test_to_thread_finished_lets_the_call_return_then_undoes_it():
    undone: list[str] = []
    release = threading.Event()

    def make():
        release.wait(5)
        return "handle"

    caller = asyncio.ensure_future(_io.to_thread_finished(make, undo=undone.append))
    await asyncio.sleep(0.02)
    caller.cancel()
    await asyncio.sleep(0.05)
    assert not caller.done()  # the blocking call still runs: the cancel waits for it
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert undone == ["handle"]


class _SlowToLetGo(rdt.Transport[None]):
    """Writes the caller's buffer 50 ms after a cancel, as a receive that cannot be interrupted."""

    name = "slow-to-let-go"
    exited = threading.Event()

    async def receive(self, info, buffers, channel):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            buffers[0].fill_(1.0)
            type(self).exited.set()
            raise
        return buffers


async def test_a_cancelled_fetch_request_returns_once_the_transport_let_go():
    into = [torch.zeros(4)]
    info = TransferInfo("o1", (TensorSpec.of(into[0]),), None)
    request = FetchRequest.start(_SlowToLetGo(), info, buffers=into)
    waiter = asyncio.ensure_future(request.wait())
    await _cancel_soon(waiter, 2)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert _SlowToLetGo.exited.is_set() and into[0].sum().item() == 4.0  # nothing writes after
    assert request.done()


class _OnCallerLoop(_SlowToLetGo):
    """As _SlowToLetGo, for a transport whose receive never blocks its loop: run on the caller's."""

    name = "on-caller-loop"
    receives_on_caller_loop = True
    exited = threading.Event()
    threads: list[threading.Thread] = []

    async def receive(self, info, buffers, channel):
        type(self).threads.append(threading.current_thread())
        return await super().receive(info, buffers, channel) if buffers[0].sum() == 0 else buffers


async def test_a_transport_that_receives_on_the_caller_loop_runs_there_and_lets_go_when_cancelled():
    ones = [torch.ones(4)]
    info = TransferInfo("o2", (TensorSpec.of(ones[0]),), None)
    done = FetchRequest.start(_OnCallerLoop(), info, buffers=ones)
    assert await done.wait() == ones and _OnCallerLoop.threads == [threading.current_thread()]

    into = [torch.zeros(4)]
    request = FetchRequest.start(_OnCallerLoop(), info, buffers=into)
    assert request.task is not None and request.task.get_loop() is asyncio.get_running_loop()
    with pytest.raises(RuntimeError, match="await it"):
        request.result(1)  # would block the loop the receive runs on
    waiter = asyncio.ensure_future(request.wait())
    await _cancel_soon(waiter, 2)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert _OnCallerLoop.exited.is_set() and into[0].sum().item() == 4.0  # nothing writes after
    assert request.done() and len(_OnCallerLoop.threads) == 2

    def from_a_thread() -> list[torch.Tensor]:  # no loop there: the I/O loop runs it
        return FetchRequest.start(_OnCallerLoop(), info, buffers=ones).result(10)

    assert await asyncio.to_thread(from_a_thread) == ones
    assert _OnCallerLoop.threads[-1] is not threading.current_thread()


async def test_poll_closely_sees_work_end_between_the_loops_other_tasks_and_gives_up_at_its_bound():
    ended = threading.Event()
    rounds = 0

    async def other_work():
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.sleep(0)

    def end_once_the_loop_ran_other_work() -> None:  # (a transfer ending in another thread)
        while rounds <= 5 and time.perf_counter() - t0 < 3:
            time.sleep(0.0005)
        ended.set()

    beside = asyncio.ensure_future(other_work())
    t0 = time.perf_counter()
    threading.Thread(target=end_once_the_loop_ran_other_work).start()
    assert await _io.poll_closely(ended.is_set, t0 + 5)
    # The loop ran its other task while it polled (else the work ends at 3 s, rounds at 1).
    assert rounds > 5 and time.perf_counter() - t0 < 2.5
    t0 = time.perf_counter()
    assert not await _io.poll_closely(lambda: False, t0 + 0.002)
    assert 0.002 <= time.perf_counter() - t0 < 1
    beside.cancel()


def test_a_thread_that_gives_up_on_a_started_coroutine_returns_once_it_let_go():
    """`Started.result` from a plain thread: at its timeout the work is cancelled and its
    cleanup has run when TimeoutError reaches the caller; a result that lands first wins."""
    events: list[str] = []

    async def holds_on(seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
            return "done"
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # a transport's abort that takes a while
            events.append("let go")
            raise

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _io.start(holds_on(30)).result(0.05)
    assert events == ["let go"] and time.monotonic() - t0 < 10
    assert _io.start(holds_on(0)).result(10) == "done"
    unstarted = _io.Started(holds_on(30))  # result() starts what was not launched
    with pytest.raises(TimeoutError):
        unstarted.result(0.05)
    assert events == ["let go", "let go"] and unstarted.wait_settled(0)


async def test_a_started_coroutine_is_awaited_from_another_loop_and_from_the_io_loop():
    async def twice(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    assert await _io.start(twice(2)) == 4  # from this (pytest's) loop

    async def nested() -> int:  # on the I/O loop: awaited there without a wrapping future
        started = _io.start(twice(3))
        assert started.task is not None
        return await started

    assert await _io.start(nested()) == 6


def test_a_transport_without_receive_cannot_be_made():
    class NoReceive(rdt.Transport[None]):
        pass

    with pytest.raises(TypeError, match=r"abstract method '?receive"):
        NoReceive()


def test_idle_sweep_lets_each_thing_go_about_idle_s_after_it_went_idle(monkeypatch):
    """Warm pools (segments, kept mappings, relay memfds) share one sweep: what goes idle
    while a sweep is pending is let go when it has been idle RDT_SHM_IDLE_S, not a round later."""
    from types import SimpleNamespace

    from rdt_async.transports import _segments

    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.6")
    lock, idle, gone = threading.Lock(), [], {}

    def sweep(cutoff):
        with lock:
            old = [x for x in idle if x.idle_since <= cutoff]
            idle[:] = [x for x in idle if x.idle_since > cutoff]
            for x in old:
                gone[x.name] = time.monotonic() - x.idle_since
            return _segments.oldest(idle)

    sweeper = _segments.IdleSweep(sweep)

    def went_idle(name):
        with lock:
            idle.append(SimpleNamespace(name=name, idle_since=time.monotonic()))
        sweeper.start()

    went_idle("a")
    time.sleep(0.15)
    went_idle("b")  # a sweep is already pending (for a, at 0.6 s)
    deadline = time.monotonic() + 5
    while len(gone) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(gone) == ["a", "b"]
    assert all(0.6 <= s < 0.95 for s in gone.values()), gone  # b too: not ~1.05 s, a round later
    assert idle == []


async def test_a_fetch_cancelled_twice_still_returns_only_once_its_transfer_let_go():
    """A second cancel (anyio's cancel scopes send one each loop round) must not cut the
    wait for the transport short: it may still be writing the caller's buffers."""
    from types import SimpleNamespace

    from rdt_async import _ray

    settled = asyncio.Event()

    async def transfer():  # as FetchRequest.wait: a cancel lets the transport settle first
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await _io.shielded(asyncio.sleep(0.3))
            settled.set()
            raise

    obj = SimpleNamespace(producer=SimpleNamespace(serves=True), obj_id="obj")
    fetch = asyncio.ensure_future(_ray.watched(transfer(), obj, "mock"))
    await asyncio.sleep(0.05)
    fetch.cancel()
    await asyncio.sleep(0.05)
    fetch.cancel()  # again, while the first cancel's cleanup runs
    with pytest.raises(asyncio.CancelledError):
        await fetch
    assert settled.is_set()


_DROPPED_UNDER_LOCKS = r"""
import os, threading, torch
from rdt_async import _alloc, _relay
from rdt_async.transports import _mappings
from rdt_async.transports._base import TensorSpec

def dropped_under(lock, make):
    box = [make()]
    done = threading.Event()
    def run():
        with lock:  # as the cyclic GC may run a finalizer inside any allocation of a locked section
            box.clear()
        done.set()
    threading.Thread(target=run, daemon=True).start()
    if not done.wait(10):
        print("deadlock")
        os._exit(1)
    return True

print("alloc", dropped_under(_alloc._lock, lambda: _alloc.empty((1 << 20,), torch.float32)), _alloc.cached_bytes())
fd = os.memfd_create("t")
os.ftruncate(fd, 1 << 20)
print("mappings", dropped_under(_mappings.cache._lock, lambda: _mappings.cache.open(fd, None)), _mappings.cache.stats()["idle"])
m = _relay.memfds.take(1 << 20)
lease = _relay._Lease(m)
spec = TensorSpec((1 << 20,), torch.uint8, "cpu", 1 << 20)
print("relay", dropped_under(_relay.memfds.lock, lambda: _relay._private(m.fd, [spec], [0], lease)), _relay.memfds.warm(1 << 20))
os._exit(0)
"""


def test_a_view_dropped_where_its_pool_is_locked_does_not_deadlock():
    """Buffers, kept mappings and relay memfds go back to their pools when their last view
    goes: from a finalizer, which may run in a thread that holds that very pool's lock (the
    cyclic GC collects inside any allocation). The finalizer only queues the work."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DROPPED_UNDER_LOCKS], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:3] == [f"alloc True {4 << 20}", "mappings True 1", "relay True True"], out.stdout + out.stderr


def test_a_watch_that_fails_is_no_verdict_on_the_producer(monkeypatch, caplog):
    """A transfer that runs long has its producer watched (is it dead?). A watch that
    fails (a GCS hiccup, a lookup error) says nothing about the producer: the transfer
    goes on and its bytes arrive, rather than a PeerDiedError that would be a lie."""
    from types import SimpleNamespace

    from rdt_async import _ray

    async def slow():
        await asyncio.sleep(0.3)
        return [torch.arange(3.0)]

    async def broken(producer):
        raise RuntimeError("GCS hiccup")

    monkeypatch.setattr(_ray, "WATCH_AFTER_S", 0.05)
    monkeypatch.setattr(_ray, "watch_producer", broken)
    obj = SimpleNamespace(producer=SimpleNamespace(serves=True, label="actor A"), obj_id="o1")
    got = asyncio.run(_ray.watched(slow(), obj, "tcp"))
    assert torch.equal(got[0], torch.arange(3.0))
    assert "could not watch actor A during the tcp fetch of o1 (RuntimeError('GCS hiccup'))" in caplog.text


def test_a_capacity_taken_at_a_steady_cadence_stays_warm_between_takes(monkeypatch):
    """Warm segments: one taken again every ~0.6 s (a trainer's step) is reused, not faulted in
    anew, though the idle time is 0.3 s; a one-off goes after the idle time; and where
    RDT_SHM_IDLE_S is set, it is the keep time exactly (the cadence is not consulted)."""
    import os

    from rdt_async.transports import _segments

    monkeypatch.delenv("RDT_SHM_IDLE_S", raising=False)
    monkeypatch.setattr(_segments, "idle_s", lambda: 0.3)
    pool = _segments.SegmentPool()

    def step(nbytes: int) -> str:
        seg = pool.take(nbytes, _segments.name_for(os.urandom(12).hex(), _segments.new_key(), nbytes))
        pool.recycle(seg.name)
        return seg.name

    try:
        step(2 << 20)  # (2 MiB: its own capacity)
        for _ in range(3):
            time.sleep(0.6)  # twice the idle time between takes
            step(2 << 20)
        assert pool.created == 2  # the first, and one more before the cadence was known
        assert pool.keep_s(2 << 20) == pytest.approx(1.2, abs=0.3)
        step(8 << 20)  # a one-off of another capacity: kept only the idle time
        assert pool.keep_s(8 << 20) == 0.3
        _wait_until(lambda: pool.stats()["idle"] == 1, 5, lambda: (pool.stats(), [(s.capacity, s.idle_since - time.monotonic()) for s in pool._idle]))  # the 8 MiB one went; the 2 MiB one waits
        monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
        assert pool.keep_s(2 << 20) == 0.3  # set: exact
        _wait_until(lambda: pool.stats()["idle"] == 0, 5)
    finally:
        for seg in list(pool._idle):
            _segments._drop(seg)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"rdt-{os.getpid()}-")]


def _wait_until(cond, timeout: float, what=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not true in {timeout} s: {what()}"
        time.sleep(0.02)


def test_the_sweep_of_idle_mappings_unmaps_them_off_the_io_loop(monkeypatch):
    """Unmapping takes its thread 10-90 ms per few hundred MiB: a sweep (on the I/O loop)
    hands the unmapping to the pool, so the loop goes on serving the transfers under way."""
    import os

    from rdt_async.transports import _mappings

    if not _mappings._keeps():
        pytest.skip("this kernel has no PAGEMAP_SCAN: idle mappings are not kept, so not swept")
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.2")
    closed: list[bool] = []
    real = _mappings._close
    monkeypatch.setattr(_mappings, "_close", lambda m: (closed.append(_io.on_io_thread()), real(m)))
    _io.io_loop()  # (started, as by a consumer's fetches: a mapping's last view queues its idling there)
    cache, fd = _mappings.MappingCache(), os.memfd_create("rdt-test-sweep")
    try:
        os.ftruncate(fd, 1 << 20)
        buf = cache.open(fd, None)
        del buf  # idle now: let go about 0.2 s later
        _wait_until(lambda: closed, 10, lambda: cache.stats())
    finally:
        os.close(fd)
    assert closed == [False] and cache.stats()["idle"] == 0  # unmapped, and not on the I/O loop


def test_a_transports_own_pool_is_declared_with_its_bound_and_made_like_the_others(monkeypatch):
    """tcp's receiving threads were a private pool of 64 beside the named ones; now every pool
    is in `_io.POOLS`, bounded, and ends with the others at exit."""
    from rdt_async.transports import tcp

    monkeypatch.setattr(_io, "POOLS", dict(_io.POOLS))
    monkeypatch.setattr(_io, "_pools", dict(_io._pools))
    assert _io.POOLS[tcp.STREAMS] == 64 and tcp._threads() is _io.pool(tcp.STREAMS)
    name = _io.declare("mine", 3)
    assert name == "mine" and _io.declare("mine", 3) == "mine"  # again, the same bound: a no-op
    with pytest.raises(ValueError, match="pool 'mine' has 3 threads, not 4"):
        _io.declare("mine", 4)
    p = _io.pool("mine")
    release = threading.Event()
    busy = [p.submit(release.wait, 10) for _ in range(5)]
    time.sleep(0.2)
    assert sum(f.running() for f in busy) == 3  # the bound holds: the rest queue
    release.set()
    assert all(f.result(10) for f in busy)
    assert sorted(t.name for t in threading.enumerate() if t.name.startswith("rdt-mine")) == [
        f"rdt-mine_{i}" for i in range(3)
    ]
    p.shutdown(wait=True)
