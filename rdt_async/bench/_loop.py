"""How long an event loop was held: a task that sleeps 1 ms at a time and times its oversleep."""

from __future__ import annotations

import asyncio
import time


class LoopStall:
    """Time the running loop's worst stall from now until `stop()`.

    Runs on: the loop it measures (make it there). A task sleeps `interval` seconds in a
    loop; whatever it oversleeps, the loop spent on something that did not yield. A few
    microseconds of Python per wake-up: cheap enough to run during every timed pass.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.worst = 0.0
        self._slept_at = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._slept_at = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.worst = max(self.worst, time.perf_counter() - self._slept_at - self.interval)

    def now(self) -> float:
        """The worst stall so far in seconds, counting one still under way."""
        return max(self.worst, time.perf_counter() - self._slept_at - self.interval, 0.0)

    def stop(self) -> float:
        """Stop watching; return the worst stall in seconds, one under way included."""
        worst = self.now()
        self._task.cancel()
        return worst
