"""One NIXL READ: posted from the I/O loop or on the caller's thread, waited for, released.

From the I/O loop, a READ up to INLINE_BYTES is posted inline when the agent is free;
a larger one is posted in the pool (under CMA the copy happens inside `transfer()`),
except reads between GPUs of one node (UCX queues a device copy: posted inline).
Either way `check_xfer_state` is then polled with backoff. On the caller's thread the
agent is held throughout and a READ still in progress after SPIN_S is handed to the I/O
loop. A cancelled READ is released only once it has ended, never while in progress:
NIXL lets go of a READ in progress over UCX's TCP, and its reply, arriving later (a
partition healing), then crashed the consumer in UCX's GET reply handler, or could write
memory given back meanwhile. It is waited for up to ABORT_GRACE_S; one still in progress
then has its connection closed, which ends it; one that outlives that too is never
released, nor the memory it lands in (`stuck`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from ... import _io
from ..._errors import TransferAbortedError
from .._kit import int_setting
from ._agent import Agent, quietly

# Reads at most this large are posted on the I/O loop; larger ones copy in the pool.
INLINE_BYTES = 256 << 10
SPIN_S = 0.0002  # how long a read done on the caller's thread may poll before handing off
# How long a transfer may stay in progress after a cancel before its handle is dropped.
ABORT_GRACE_S = 5.0
# A READ still in progress after STALL_S, or the time its bytes take at STALL_BYTES_PER_S
# if longer, has stalled: NIXL can leave one in progress for good, its endpoint failed
# under it or its peer not progressing (ai-dynamo/nixl#2047). It is cut off as a cancelled
# one is (`disconnect`) and fails with ReadStalled; the consumer reads again once, over a
# fresh connection. (Read at each READ: a test may lower it.)
STALL_S = float(int_setting("RDT_NIXL_STALL_S", 30, 1, "seconds as an integer >= 1"))
STALL_BYTES_PER_S = 10 << 20
# GPU-to-GPU reads on one node (UCX's cuda_ipc) end in microseconds to milliseconds and
# move only while the consumer polls: the loop's backoff (sleeps under 1 ms last 1 ms)
# held a 256 MiB read (0.18 ms raw) to 2.3 ms on an H200. They are posted inline (UCX
# queues device copies: no wait) and polled between the loop's other work for up to
# LOOP_POLL_S (no hop to the pool and back, ~0.3 ms), then from the pool every ~20 µs
# up to DEVICE_POLL_S (the loop's thread is not kept busy longer), then with the backoff.
LOOP_POLL_S, DEVICE_POLL_S = 0.003, 0.05

Region = tuple[int, int, int]  # address, nbytes, device index


class ReadStalled(TransferAbortedError):
    """A READ stayed in progress past its stall bound (STALL_S) and was cut off."""


def stall_bound(nbytes: int) -> float:
    """How long a READ of `nbytes` may stay in progress before it counts as stalled."""
    return max(STALL_S, nbytes / STALL_BYTES_PER_S)


class Read(NamedTuple):
    """One READ request: local regions it fills from remote ones, of one memory type each."""

    local: list[Region]
    remote: list[Region]
    local_mem: str = "DRAM"
    remote_mem: str = "DRAM"
    on_device: bool = False  # GPU memory at both ends, on one node: polled closely (DEVICE_POLL_S)

    @property
    def nbytes(self) -> int:
        return sum(r[1] for r in self.remote)


async def post(
    agent: Agent, remote: str, read: Read, disconnect: Callable[[], Awaitable[None]], stuck: Callable[[], None],
    gone: Callable[[], bool],
) -> None:
    """READ from `remote` and wait for it; release the handle whatever happens.

    A READ a cancel cannot release within ABORT_GRACE_S, or one that stalled
    (`stall_bound`): `disconnect()` closes the connection to `remote` (ending the READ in
    UCX), and if NIXL still holds it, `stuck()` says that its memory must never be given back.
    A READ cancelled once `gone()` (Ray declared the producer dead: a partition holds its
    reply up) is cut off at once, not after the grace.
    Runs on: consumer (I/O loop). Posts inline up to INLINE_BYTES, else in the pool.
    Raises: ReadStalled, TransferAbortedError, NIXL's errors.
    """
    nx = agent.nixl
    began = time.monotonic()
    handle = await agent.call(
        nx.initialize_xfer, "READ", nx.get_xfer_descs(read.local, read.local_mem),
        nx.get_xfer_descs(read.remote, read.remote_mem), remote,
        undo=lambda h: agent.call_soon(release, nx, h),
    )
    state, stalled = "PROC", False
    try:
        state = await agent.call(nx.transfer, handle, slow=read.nbytes > INLINE_BYTES and not read.on_device)
        if state == "PROC" and read.on_device:
            state = await _poll_on_loop(agent, handle, LOOP_POLL_S)
        if state == "PROC" and read.on_device:
            state = await _io.to_thread_finished(_poll_closely, agent, handle)
        if state == "PROC":
            bound = stall_bound(read.nbytes)
            left = max(0.001, began + bound - time.monotonic())  # (looked at once, however long posting took)
            state = await _wait_state(agent, handle, within=left)
            if state == "PROC":
                stalled = True
                raise ReadStalled(
                    f"nixl READ of {read.nbytes} bytes from {remote} stalled: still in progress after "
                    f"{time.monotonic() - began:.0f} s (the bound is RDT_NIXL_STALL_S={STALL_S:.0f} s, or "
                    f"{STALL_BYTES_PER_S >> 20} MiB/s for larger reads); its connection is cut off"
                )
        if state != "DONE":
            raise TransferAbortedError(f"nixl READ from {remote} ended in state {state}")
    finally:
        if state == "PROC":  # cancelled, or stalled: cut off at once (a stalled READ had its grace, a dead producer's needs none)
            if (not stalled and not gone() and await _ended(agent, handle)) or await _ended(agent, handle, before=disconnect):
                agent.call_soon(release, nx, handle)
            else:
                keep(handle)
                stuck()
        else:
            agent.call_soon(release, nx, handle)


def post_now(agent: Agent, remote: str, read: Read, on_end: Callable[[], None], stuck: Callable[[], None]) -> bool:
    """READ DRAM regions on this thread, the agent held (by the caller); False if NIXL left it in progress.

    A READ left in progress is handed to the I/O loop, which releases its handle and
    calls `on_end` once it ends (`stuck` instead if it is still in progress after
    ABORT_GRACE_S: never released, nor its memory given back). Raises: TransferAbortedError, NIXL's errors.
    """
    nx = agent.nixl
    handle = nx.initialize_xfer("READ", nx.get_xfer_descs(read.local, "DRAM"), nx.get_xfer_descs(read.remote, "DRAM"), remote)
    try:
        state = nx.transfer(handle)
        deadline = time.perf_counter() + SPIN_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = nx.check_xfer_state(handle)
    except BaseException:
        quietly(release, nx, handle)
        raise
    if state == "PROC":
        _io.call_soon(_finish_later, agent, handle, on_end, stuck)
        return False
    quietly(release, nx, handle)
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


async def _poll_on_loop(agent: Agent, handle: Any, within: float) -> str:
    """Poll a posted transfer between the loop's other work for up to `within` s; return its state."""
    state = "PROC"

    def ended() -> bool:
        nonlocal state
        state = agent.try_call(agent.nixl.check_xfer_state, handle, busy=state)
        return bool(state != "PROC")

    await _io.poll_closely(ended, time.perf_counter() + within)
    return state


def _poll_closely(agent: Agent, handle: Any) -> str:
    """Poll a posted transfer every ~20 µs for up to DEVICE_POLL_S (in the pool); return its state."""
    deadline = time.perf_counter() + DEVICE_POLL_S
    state = "PROC"
    while state == "PROC" and time.perf_counter() < deadline:
        state = agent.try_call(agent.nixl.check_xfer_state, handle, busy=state)
        if state == "PROC":
            time.sleep(20e-6)
    return state


def release(nx: Any, handle: Any) -> None:
    """Release a READ's handle (the agent held). One NIXL will not release is kept (`keep`).

    Raises: NIXL's error.
    """
    try:
        nx.release_xfer_handle(handle)
    except BaseException:
        keep(handle)
        raise


def keep(handle: Any) -> None:
    """Keep a READ's handle for the process's life, never released: NIXL's handle releases
    itself once garbage (`nixl_xfer_handle.__del__`), from whatever thread collects it,
    without the agent's lock and whether the READ ended or not: a READ still in progress
    (`stuck`) must never be let go (see the module's docstring), nor one NIXL refused to
    release be released again at some later collection, inside another call into the
    agent (a consumer of the contract suite died once of a SIGSEGV in a garbage
    collection inside `transfer`)."""
    _kept_handles.append(handle)
    with contextlib.suppress(AttributeError):  # (a NIXL whose handles have no such flag)
        handle._released = True  # its finalizer releases only where this is False


_kept_handles: list[Any] = []


def _finish_later(agent: Agent, handle: Any, on_end: Callable[[], None], stuck: Callable[[], None]) -> None:
    """Wait on the I/O loop for a READ left in progress, release it, then call `on_end`
    (`stuck` where it is still in progress after ABORT_GRACE_S)."""

    async def finish() -> None:
        try:
            try:
                state = await _wait_state(agent, handle, ABORT_GRACE_S)
            except Exception:
                state = "ERR"
            if state == "PROC":
                keep(handle)
                stuck()
                return  # never released, nor its memory given back (on_end not called)
            agent.call_soon(release, agent.nixl, handle)
        except BaseException:
            on_end()
            raise
        on_end()

    task = asyncio.get_running_loop().create_task(finish())
    _finishing.add(task)  # the loop keeps tasks only weakly
    task.add_done_callback(_finishing.discard)


_finishing: set[asyncio.Task[None]] = set()


async def _ended(agent: Agent, handle: Any, before: Callable[[], Awaitable[None]] | None = None) -> bool:
    """Wait (through any cancel) up to ABORT_GRACE_S for a READ to leave PROC; `before`
    runs first. Returns whether it ended (done or failed: its handle may be released)."""
    if before is not None:
        done = asyncio.ensure_future(before())
        await _io.shielded(done)
        if not done.cancelled():
            done.exception()  # retrieved: where it failed, the READ's state says whether that mattered

    async def wait() -> str:
        try:
            return await _wait_state(agent, handle, ABORT_GRACE_S)
        except Exception:
            return "ERR"  # NIXL's error: no longer in progress

    state = asyncio.ensure_future(wait())
    await _io.shielded(state)
    return state.result() != "PROC"
