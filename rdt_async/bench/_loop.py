"""How long an event loop was held: a task that sleeps 1 ms at a time and times its oversleep."""

from __future__ import annotations

import asyncio
import os
import time


def schedstat(path: str | int) -> tuple[float, float]:
    """A thread's time on a core and time waiting, runnable, for one (s): its schedstat,
    by path or open descriptor. Zeros where the kernel keeps none."""
    try:
        if isinstance(path, int):
            fields = os.pread(path, 128, 0).split()
        else:
            with open(path, "rb") as f:
                fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


class LoopStall:
    """Time the running loop's worst stall from now until `stop()`.

    Runs on: the loop it measures (make it there). A task sleeps `interval` seconds in a
    loop; whatever it oversleeps, the loop spent on something that did not yield. A few
    microseconds of Python per wake-up: cheap enough to run during every timed pass.

    `worst` is what a caller on that loop felt. `held` is the same less the time the
    loop's thread waited, runnable, for a core (the kernel's schedstat, where it keeps
    one): what the process held the loop for, where `worst` also counts a machine with
    more busy processes than cores (8 consumers on 2 cores, all copying).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.worst = 0.0
        self.held = 0.0
        self._slept_at = time.perf_counter()
        try:  # (made on the loop's thread, as the class says: this thread's counters)
            self._sched: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._sched = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _core_wait(self) -> float:
        """Seconds this thread has waited, runnable, for a core (0 where unknown)."""
        return 0.0 if self._sched is None else schedstat(self._sched)[1]

    async def _run(self) -> None:
        while True:
            self._slept_at, waited = time.perf_counter(), self._core_wait()
            await asyncio.sleep(self.interval)
            late = time.perf_counter() - self._slept_at - self.interval
            self.worst = max(self.worst, late)
            self.held = max(self.held, late - (self._core_wait() - waited))

    def now(self) -> float:
        """The worst stall so far in seconds, counting one still under way."""
        return max(self.worst, time.perf_counter() - self._slept_at - self.interval, 0.0)

    def stop(self) -> float:
        """Stop watching; return the worst stall in seconds, one under way included."""
        worst = self.now()
        self._task.cancel()
        if self._sched is not None:
            os.close(self._sched)
            self._sched = None
        return worst
