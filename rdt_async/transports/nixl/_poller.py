"""The producer's poll of `get_new_notifs()`: the passive side must progress, or wire-up hangs.

It runs on the I/O loop with backoff: up to every POLL_MAX_S while the agent has memory
registered, every POLL_IDLE_S once it has none (with RDT_NIXL_PROGRESS_US=0, no progress
thread, that poll is all that progresses the agent).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from ... import _io
from ._agent import Agent

POLL_MIN_S, POLL_MAX_S = 0.001, 0.02
POLL_IDLE_S = 0.25  # the producer's pace once it holds nothing (consumers may still wire up)


class Poller:
    """One task per agent, started by the first object; its fields live on the I/O loop."""

    def __init__(self, agent: Agent, busy: Callable[[], bool]) -> None:
        self._agent, self._busy = agent, busy  # busy: the agent has memory registered
        self._task: asyncio.Task[None] | None = None
        self._idle = False  # the task holds nothing and sleeps at POLL_IDLE_S
        self._wake: asyncio.Future[None] | None = None

    def ensure(self) -> None:
        """Have the poll run at its quick pace (from any thread; a new object is there)."""
        if self._task is None or self._task.done() or self._idle:
            _io.call_soon(self._start)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())
        elif self._idle and self._wake is not None and not self._wake.done():
            self._wake.set_result(None)  # objects again: back to the quick pace

    async def _poll(self) -> None:
        """Progress the agent, so that consumers can wire up, for as long as it lives.

        Runs on: producer (I/O loop). Backs off to POLL_MAX_S while memory is registered
        and nothing arrives, and to POLL_IDLE_S once none is: a consumer whose first
        contact is a fetch of an object freed meanwhile still wires up (and learns it is
        freed) instead of waiting forever for a producer that no longer progresses.
        """
        loop = asyncio.get_running_loop()
        agent = self._agent
        delay = POLL_MIN_S
        while agent.pid == os.getpid():
            try:
                notifs = agent.try_call(agent.nixl.get_new_notifs, busy=None)
            except Exception:
                notifs = {}
            if notifs:
                delay = POLL_MIN_S
            self._idle = not self._busy()
            self._wake = loop.create_future()
            wake = loop.call_later(delay, _io.set_once, self._wake)
            await self._wake
            wake.cancel()
            if self._idle and self._busy():
                delay = POLL_MIN_S  # woken by a new object
            else:
                delay = min(POLL_IDLE_S if self._idle else POLL_MAX_S, delay * 2)

