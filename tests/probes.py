"""Checks that need neither Ray nor actors: the GPU machine runs the contract suite with these."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

from rdt_async.bench._loop import schedstat


def checksum(t: torch.Tensor) -> float:
    return float(t.double().sum())


def open_fds() -> dict[str, str]:
    """This process's open descriptors and what each points at. One readlink per descriptor:
    Ray's threads open and close descriptors all the time, so one that closes between the
    listing and the read is left out (reading twice raced, and failed CI)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return out


def listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, IPv4 and IPv6: its own
    descriptors (`open_fds`), found in its network namespace's /proc tables. A v4-mapped
    IPv6 address reads as IPv4."""
    import socket

    mine = {link[8:-1] for link in open_fds().values() if link.startswith("socket:[")}
    out = set()
    for table, family, size in (("tcp", socket.AF_INET, 4), ("tcp6", socket.AF_INET6, 16)):
        with open(f"/proc/self/net/{table}") as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in mine:  # 0A: LISTEN
                    continue
                raw, port = cols[1].split(":")
                packed = bytes.fromhex(raw)
                packed = b"".join(packed[i : i + 4][::-1] for i in range(0, size, 4))  # host-order words
                out.add((socket.inet_ntop(family, packed).removeprefix("::ffff:"), int(port, 16)))
    return out


def kill_and_wait(actor: Any, timeout: float = 60.0) -> None:
    """`ray.kill(actor)`, returning once Ray fails its calls (RayActorError): a call made
    right after `ray.kill` may still run, as the kill reaches the actor later."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{actor} still answers {timeout} s after ray.kill")
        time.sleep(0.1)


def cpu_seconds() -> float:
    """CPU time (user + system) of this process so far, from /proc."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(seconds: float) -> float:
    """CPU this process burns over `seconds` while the calling thread sleeps."""
    t0 = cpu_seconds()
    time.sleep(seconds)
    return cpu_seconds() - t0


class Threads:
    """Where this process's threads spent their time, per thread: the loop's through a
    descriptor opened once (`start`, before the code under test counts descriptors), the
    other Python threads' (those that take the GIL) read and closed at once."""

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.skip: set[int | None] = {loop_thread, None}  # (and the probe's own watcher, once started)
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{loop_thread}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def loop(self) -> tuple[float, float]:
        return schedstat(self._fd) if self._fd is not None else (0.0, 0.0)

    def others(self) -> dict[int, tuple[float, float]]:
        """Each other Python thread's time on a core and time waiting for one."""
        if self._fd is None:
            return {}
        ids = {t.native_id for t in threading.enumerate()} - self.skip
        return {tid: schedstat(f"/proc/self/task/{tid}/schedstat") for tid in ids}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Collections:
    """The garbage collections this process ran while installed, and on which thread: a
    full one walks every object of the process (130 ms here with torch and Ray imported),
    holding the GIL, on whichever thread allocated last, or on Ray's PythonGCThread when
    Ray asks every worker for one."""

    def __init__(self) -> None:
        self.done: list[tuple[float, float, int, int]] = []  # (start, end, generation, thread ident)
        self._started: dict[int, float] = {}

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # (Runs at every collection, on any thread: names are looked up at report time, as
        # `current_thread()` here would register a thread of Ray's C++ as a Python one.)
        now, ident = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[ident] = now
        elif (began := self._started.pop(ident, None)) is not None and now - began > 0.005:
            self.done.append((began, now, info["generation"], ident))
            del self.done[:-50]

    def between(self, t0: float, t1: float) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        return ", ".join(
            f"a generation-{gen} collection ran {(min(end, t1) - max(start, t0)) * 1000:.0f} ms "
            f"on {names.get(ident, f'thread {ident}')}"
            for start, end, gen, ident in self.done if end > t0 and start < t1
        )


class LagProbe:
    """Measures how late an event loop wakes a 5 ms sleeper: a blocked loop shows here.

    A wake-up is late because something held the loop (a copy on its thread, a native wait,
    another of our threads keeping the GIL) or because the machine gave the process no
    core (another process, another test worker). Only the first is the code's doing. The
    kernel says, per thread, how long each was on a core and how long it waited, runnable,
    for one. So `max_lag` is the worst lateness less what the cores excuse: the time the
    loop's thread waited for one, and, of the time it was asleep past its 5 ms (on the GIL,
    a lock or a blocking call), no more than another Python thread of ours waited for a
    core meanwhile (a GIL holder the machine preempted). `max_late` is the lateness as it
    was; `report()` says both, and how the worst wake-up's time was spent.

    A watcher thread samples the loop thread's stack while a wake-up is over 20 ms late:
    `culprit` is the sample from the worst stall, so a failing bound names what held the
    loop (a call of ours, or `select` when the process or the GIL was the holdup).
    """

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.max_late = 0.0
        self.worst = ""  # how the worst wake-up's time was spent
        self.worst_ran = 0.0  # the longest another Python thread ran meanwhile (s)
        self.max_excused = 0.0  # the most a wake-up's GIL wait was excused (s): a holder's core wait
        self.culprit = ""
        self._task: asyncio.Task[None] | None = None
        self._beat = 0.0
        self._stop = threading.Event()
        self._threads: Threads | None = None
        self._collections = Collections()

    def start(self) -> None:
        self.max_lag, self.max_late, self.worst, self.worst_ran, self.culprit = 0.0, 0.0, "", 0.0, ""
        self.max_excused = 0.0
        self._beat = time.perf_counter()
        self._stop.clear()
        if self._threads is not None:
            self._threads.close()
        self._threads = Threads(threading.get_native_id())
        self._collections.remove()
        self._collections = Collections()
        self._collections.install()
        self._task = asyncio.get_running_loop().create_task(self._run(self._threads))
        watcher = threading.Thread(
            target=self._watch, args=(threading.get_ident(),), daemon=True, name="lag-probe"
        )
        watcher.start()
        # The watcher's own waits for a core excuse nothing: it holds the GIL only to sample,
        # and a stall it sampled (a blocking call on the loop's thread) must not be excused
        # by the time the sampling itself waited for a core.
        self._threads.skip.add(watcher.native_id)

    async def stop(self) -> float:
        assert self._task is not None
        self._stop.set()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        if self._threads is not None:
            self._threads.close()
        self._collections.remove()
        return self.max_lag

    def report(self) -> str:
        """The worst lag, how that wake-up's time went, and the loop's stack during it."""
        return (
            f"loop blocked {self.max_lag * 1000:.0f} ms ({self.worst or 'no wake-up was late'}; "
            f"the latest wake-up of all: {self.max_late * 1000:.0f} ms late)"
            + (f"; the loop thread was in:\n{self.culprit}" if self.culprit else "")
        )

    async def _run(self, threads: Threads) -> None:
        # From one wake-up to the next, reads included: the GIL can be lost in those too.
        # The other threads' counters are read every 50 ms and at a late wake-up (a read a
        # tick costs ~15% of a core with Ray's threads): a late wake-up weighs them over
        # its own time and at most the 50 ms before it.
        (cpu0, wait0), others0 = threads.loop(), threads.others()
        t0 = self._beat = since = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            cpu1, wait1 = threads.loop()
            t1 = time.perf_counter()
            others1 = None
            if t1 - t0 > 0.025 or t1 - since > 0.05:
                others1 = threads.others()
                (cpu1, wait1), t1 = threads.loop(), time.perf_counter()
            late, waited = t1 - t0 - 0.005, wait1 - wait0
            self.max_late = max(self.max_late, late)
            if others1 is not None:
                self._weigh(t0, t1, late, cpu1 - cpu0, waited, others0, others1)
                others0, since = others1, t1
            elif late - waited > self.max_lag:  # (at most 20 ms late: no other thread's read)
                self.max_lag, self.worst = late - waited, f"that wake-up was {late * 1000:.0f} ms late"
            (cpu0, wait0), t0 = (cpu1, wait1), t1
            self._beat = t1

    def _weigh(self, t0: float, t1: float, late: float, cpu: float, waited: float,
               others0: dict[int, tuple[float, float]], others1: dict[int, tuple[float, float]]) -> None:
        asleep = max(0.0, late - cpu - waited)  # past its sleep: the GIL, a lock, a blocking call
        zero = (0.0, 0.0)  # (a thread started since the last read: all its time is since)
        others = max((others1[t][1] - others0.get(t, zero)[1] for t in others1), default=0.0)
        lag = late - waited - min(asleep, others)
        self.max_excused = max(self.max_excused, min(asleep, others))
        if lag > self.max_lag:
            self.max_lag = lag
            ran = max(((others1[t][0] - others0.get(t, zero)[0], t) for t in others1), default=(0.0, 0))
            self.worst_ran = ran[0]
            names = {t.native_id: t.name for t in threading.enumerate()}
            self.worst = "; ".join(filter(None, (
                f"that wake-up was {late * 1000:.0f} ms late: the loop's thread ran {cpu * 1000:.0f} ms, "
                f"waited {waited * 1000:.0f} ms for a core and slept {asleep * 1000:.0f} ms past its 5 ms "
                f"while another Python thread of ours waited up to {others * 1000:.0f} ms for one "
                f"(the busiest, {names.get(ran[1], ran[1])}, ran {ran[0] * 1000:.0f} ms)",
                self._collections.between(t0, t1),
            )))

    def _watch(self, loop_thread: int) -> None:
        worst, sampled = 0.02, False
        while not self._stop.wait(0.005):
            late = time.perf_counter() - self._beat - 0.005
            if late > worst and loop_thread in (frames := sys._current_frames()):
                worst = late * 1.5  # (a sample formats every thread's stack: ~2 ms of a core each,
                # so a stall is sampled at 20, 30, 45, 68 ... ms, not every 10 ms)
                if not _within(frames[loop_thread], LagProbe._run.__code__):
                    self.culprit, sampled = _stacks(frames, loop_thread), True
                elif not sampled:  # the loop has woken and waits in the probe's own reads (the GIL)
                    self.culprit, sampled = ("(the loop had woken and was reading the kernel's counters: the other "
                                             "threads' stacks say who held the GIL)\n" + _stacks(frames, loop_thread), True)
            elif late < 0.02:  # (a stall's first sample stays once the loop is back in the probe)
                sampled = False
            frames = {}  # a frame held past its function's return keeps its locals (and the values in them)


def _within(frame: Any, code: Any) -> bool:
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _stacks(frames: dict[int, Any], loop_thread: int) -> str:
    """The loop thread's stack, then the others': where the loop waited in `select`,
    another thread held the GIL, and these say what they ran when the loop got it back."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = "".join(traceback.format_stack(frames[loop_thread])[-8:])
    for ident, frame in frames.items():
        if ident not in (loop_thread, threading.get_ident()):
            lines = "".join(line for line in traceback.format_stack(frame) if "importlib" not in line)
            out += f"  [{names.get(ident, ident)}]\n{lines[-1500:]}"
    return out


async def cancel_after(awaitable: Any, seconds: float) -> str:
    """Start `awaitable`, cancel it after `seconds`: "done" if it finished first, else "cancelled"."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.sleep(seconds)
    task.cancel()
    try:
        await task
        return "done"
    except asyncio.CancelledError:
        return "cancelled"


def _what_waits(_actor: Any = None) -> str:
    """Every busy thread's stack, and every pending task of the process's running loops (run in an actor)."""
    import io

    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    out.write(f"=== pid {os.getpid()}\n")
    frames = sys._current_frames()
    for ident, frame in frames.items():
        idle = frame.f_code.co_name in ("select", "poll", "wait") or "work_queue.get" in "".join(
            traceback.format_stack(frame, limit=1)
        )
        if ident != threading.get_ident() and not idle:  # (pool threads waiting for work, idle loops: left out)
            out.write(f"--- thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame)[-8:])}")
    for ident, frame in frames.items():  # the loops threads run (gc may not list them: frozen)
        while frame is not None and not isinstance(frame.f_locals.get("self"), asyncio.AbstractEventLoop):
            frame = frame.f_back
        if frame is not None:
            loop = frame.f_locals["self"]
            for task in asyncio.all_tasks(loop):
                out.write(f"--- task {task.get_name()} on the loop of thread {names.get(ident, ident)}\n")
                out.write(_awaits(task.get_coro()))
    return out.getvalue()


def _awaits(coro: Any) -> str:
    """Where a suspended coroutine waits: each coroutine of its chain of awaits, outermost first."""
    lines = []
    while coro is not None and len(lines) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None and frame is None:
            lines.append(f"  {coro!r}\n"[:300])  # (a coroutine of Cython's, a future: where it ends)
        coro = inner
    return "".join(lines)


def what_waits(actors: list[Any], timeout: float = 20.0) -> str:
    """What each actor's busy threads and the tasks of its loops (rdt_async's I/O loop,
    Ray's) wait on now: for a test whose fetch did not end, so that its failure says where."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (workers may not find this module)
    out = []
    for actor in actors:
        try:
            out.append(ray.get(actor.__ray_call__.remote(_what_waits), timeout=timeout))
        except Exception as exc:  # an actor that died, or whose threads do not answer
            out.append(f"=== {actor}: no answer ({type(exc).__name__}: {exc})")
    return "\n".join(out)


def get_or_explain(refs: Any, actors: list[Any], timeout: float) -> Any:
    """`ray.get(refs, timeout=timeout)`; where it times out, fail with what every actor
    waits on (`what_waits`)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise AssertionError(f"not done in {timeout} s; the actors wait on:\n{what_waits(actors)}") from None


@contextlib.contextmanager
def nixl_stalling(nx, until_removed: str | None, others_fail: bool = False):
    """Emulate READs NIXL leaves in progress for good (ai-dynamo/nixl#2047: their endpoint
    failed under them, or their peer stopped progressing): each READ posted is done, but
    NIXL says it is in progress, until the remote agent `until_removed` is removed (None:
    for good); then the first says its real state and, with `others_fail`, the others
    "ERR" (NIXL's state for a READ whose remote agent was removed under it). Yields the
    READs stalled (their handles' ids, in order) and the remote agents removed."""
    stuck, removed = [], []
    real_transfer, real_check, real_remove = nx.transfer, nx.check_xfer_state, nx.remove_remote_agent

    def ended() -> bool:
        return until_removed is not None and until_removed in removed

    def transfer(handle, *args):
        state = real_transfer(handle, *args)
        if ended():
            return state
        stuck.append(id(handle))
        return "PROC"

    def check_xfer_state(handle):
        if id(handle) not in stuck:
            return real_check(handle)
        if not ended():
            return "PROC"
        return "ERR" if others_fail and id(handle) != stuck[0] else real_check(handle)

    nx.transfer, nx.check_xfer_state = transfer, check_xfer_state
    nx.remove_remote_agent = lambda name: removed.append(name) or real_remove(name)
    try:
        yield stuck, removed
    finally:
        del nx.transfer, nx.check_xfer_state, nx.remove_remote_agent
