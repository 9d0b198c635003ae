"""One NIXL READ: posted from the I/O loop or on the caller's thread, waited for, released.

From the I/O loop, a READ up to INLINE_BYTES is posted inline when the agent is free;
a larger one is posted in the pool (under CMA the copy happens inside `transfer()`).
Either way `check_xfer_state` is then polled with backoff. On the caller's thread the
agent is held throughout and a READ still in progress after SPIN_S is handed to the I/O
loop. Cancelling releases the handle, after any copy already running in the pool has
ended; a READ NIXL cannot cancel yet is waited for up to ABORT_GRACE_S.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ... import _io
from ..._errors import TransferAbortedError
from ._agent import Agent, quietly

# Reads at most this large are posted on the I/O loop; larger ones copy in the pool.
INLINE_BYTES = 256 << 10
SPIN_S = 0.0002  # how long a read done on the caller's thread may poll before handing off
# How long a transfer may stay in progress after a cancel before its handle is dropped.
ABORT_GRACE_S = 5.0

Region = tuple[int, int, int]  # address, nbytes, device index


class Read(NamedTuple):
    """One READ request: local regions it fills from remote ones, of one memory type each."""

    local: list[Region]
    remote: list[Region]
    local_mem: str = "DRAM"
    remote_mem: str = "DRAM"

    @property
    def nbytes(self) -> int:
        return sum(r[1] for r in self.remote)


async def post(agent: Agent, remote: str, read: Read) -> None:
    """READ from `remote` and wait for it; release the handle whatever happens.

    Runs on: consumer (I/O loop). Posts inline up to INLINE_BYTES, else in the pool.
    Raises: TransferAbortedError, NIXL's errors.
    """
    nx = agent.nixl
    handle = await agent.call(
        nx.initialize_xfer, "READ", nx.get_xfer_descs(read.local, read.local_mem),
        nx.get_xfer_descs(read.remote, read.remote_mem), remote,
        undo=lambda h: agent.call_soon(nx.release_xfer_handle, h),
    )
    state = "PROC"
    try:
        state = await agent.call(nx.transfer, handle, slow=read.nbytes > INLINE_BYTES)
        if state == "PROC":
            state = await _wait_state(agent, handle)
        if state != "DONE":
            raise TransferAbortedError(f"nixl READ from {remote} ended in state {state}")
    finally:
        if state == "PROC":
            await _abort(agent, handle)
        else:
            agent.call_soon(nx.release_xfer_handle, handle)


def post_now(agent: Agent, remote: str, read: Read, on_end: Callable[[], None]) -> bool:
    """READ DRAM regions on this thread, the agent held (by the caller); False if NIXL left it in progress.

    A READ left in progress is handed to the I/O loop, which releases its handle and
    calls `on_end` once it ends. Raises: TransferAbortedError, NIXL's errors.
    """
    nx = agent.nixl
    handle = nx.initialize_xfer("READ", nx.get_xfer_descs(read.local, "DRAM"), nx.get_xfer_descs(read.remote, "DRAM"), remote)
    try:
        state = nx.transfer(handle)
        deadline = time.perf_counter() + SPIN_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = nx.check_xfer_state(handle)
    except BaseException:
        quietly(nx.release_xfer_handle, handle)
        raise
    if state == "PROC":
        _io.call_soon(_finish_later, agent, handle, on_end)
        return False
    quietly(nx.release_xfer_handle, handle)
    if state != "DONE":
        raise TransferAbortedError(f"nixl READ from {remote} ended in state {state}")
    return True


async def _wait_state(agent: Agent, handle: Any, within: float | None = None) -> str:
    """Poll a posted transfer from the I/O loop with backoff until it leaves PROC (or `within` s pass).

    Raises: NIXL's error from `check_xfer_state`.
    """
    deadline = None if within is None else time.monotonic() + within
    delay, state = 0.0, "PROC"
    while state == "PROC" and (deadline is None or time.monotonic() < deadline):
        await asyncio.sleep(delay)
        delay = min(0.005, delay * 2 or 0.0002)
        state = agent.try_call(agent.nixl.check_xfer_state, handle, busy=state)
    return state


def _finish_later(agent: Agent, handle: Any, on_end: Callable[[], None]) -> None:
    """Wait on the I/O loop for a READ left in progress, release it, then call `on_end`."""

    async def finish() -> None:
        try:
            try:
                state = await _wait_state(agent, handle, ABORT_GRACE_S)
            except Exception:
                state = "ERR"
            if state == "PROC":
                await _abort(agent, handle)
            else:
                agent.call_soon(agent.nixl.release_xfer_handle, handle)
        finally:
            on_end()

    task = asyncio.get_running_loop().create_task(finish())
    _finishing.add(task)  # the loop keeps tasks only weakly
    task.add_done_callback(_finishing.discard)


_finishing: set[asyncio.Task[None]] = set()


async def _abort(agent: Agent, handle: Any) -> None:
    """Release an in-progress transfer: NIXL cancels it, or we wait (bounded) until it ends."""
    nx = agent.nixl
    deadline = time.monotonic() + ABORT_GRACE_S
    while True:
        release = asyncio.ensure_future(agent.call(nx.release_xfer_handle, handle))
        await _io.shielded(release)
        if release.exception() is None:
            return  # (an exception: NIXL could not cancel it yet)
        if time.monotonic() > deadline:
            return  # NIXL keeps the handle on its leak list and frees it with the agent
        await _io.shielded(asyncio.sleep(0.001))
