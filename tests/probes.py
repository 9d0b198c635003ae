"""Checks that need neither Ray nor actors: the GPU machine runs the contract suite with these."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch


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


class RunDelay:
    """How long a thread has waited, runnable, for a core: the kernel's schedstat for it
    (its second field, in ns). Zero where the kernel does not keep it."""

    def __init__(self, native_id: int) -> None:
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LagProbe:
    """Measures how late an event loop wakes a 5 ms sleeper: a blocked loop shows here.

    A late wake-up has two causes: something held the loop (a copy on its thread, a native
    wait, another of our threads keeping the GIL), or the loop's thread was ready to run and
    the machine gave it no core (another process, another test worker). Only the first is
    the code's doing, so `max_lag` is the worst wake-up's lateness less the time the loop's
    thread spent waiting for a core meanwhile (the kernel counts it, per thread), and
    `max_late` the lateness as it was; `report()` says both.

    A watcher thread samples the loop thread's stack while a wake-up is over 20 ms late:
    `culprit` is the sample from the worst stall, so a failing bound names what held the
    loop (a call of ours, or `select` when the process or the GIL was the holdup).
    """

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.max_late = 0.0
        self.waited = 0.0  # for a core, during the wake-up with the worst max_lag
        self.culprit = ""
        self._task: asyncio.Task[None] | None = None
        self._beat = 0.0
        self._stop = threading.Event()
        self._run_delay: RunDelay | None = None

    def start(self) -> None:
        self.max_lag, self.max_late, self.waited, self.culprit = 0.0, 0.0, 0.0, ""
        self._beat = time.perf_counter()
        self._stop.clear()
        # Opened here, before the code under test runs: a test that counts this process's
        # descriptors around its body sees none of the probe's come or go.
        if self._run_delay is not None:
            self._run_delay.close()
        self._run_delay = RunDelay(threading.get_native_id())
        self._task = asyncio.get_running_loop().create_task(self._run(self._run_delay))
        threading.Thread(
            target=self._watch, args=(threading.get_ident(),), daemon=True, name="lag-probe"
        ).start()

    async def stop(self) -> float:
        assert self._task is not None
        self._stop.set()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        if self._run_delay is not None:
            self._run_delay.close()
        return self.max_lag

    def report(self) -> str:
        """The worst lag, and the loop's stack during it if one was sampled."""
        return (
            f"loop blocked {self.max_lag * 1000:.0f} ms (that wake-up was "
            f"{(self.max_lag + self.waited) * 1000:.0f} ms late, {self.waited * 1000:.0f} ms of it waiting for a core; "
            f"the latest of all: {self.max_late * 1000:.0f} ms)"
            + (f"; the loop thread was in:\n{self.culprit}" if self.culprit else "")
        )

    async def _run(self, run_delay: RunDelay) -> None:
        while True:
            d0 = run_delay()
            t0 = self._beat = time.perf_counter()
            await asyncio.sleep(0.005)
            late = time.perf_counter() - t0 - 0.005
            waited = run_delay() - d0
            self.max_late = max(self.max_late, late)
            if late - waited > self.max_lag:
                self.max_lag, self.waited = late - waited, waited

    def _watch(self, loop_thread: int) -> None:
        worst = 0.02
        while not self._stop.wait(0.005):
            late = time.perf_counter() - self._beat - 0.005
            if late > worst and loop_thread in (frames := sys._current_frames()):
                worst = late
                self.culprit = _stacks(frames, loop_thread)
            frames = {}  # a frame held past its function's return keeps its locals (and the values in them)


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
