"""The per-process I/O loop thread, one bounded thread pool per purpose, and loop bridging.

Every transfer of a process runs as a task on one event loop owned by rdt_async (the
I/O loop). `start(coro)` is the one way onto it: callers on other loops await the
`Started` it returns, blocking callers wait with its `result()`.
Nothing here starts before it is first used, or before an `rdt.remote` actor's creation
(`prestart`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("rdt_async")

# Blocking work runs in one bounded pool per purpose, so that one kind never starves
# another (a copy never waits behind a GCS call, an abort never behind the receives it
# aborts); more in-flight work of a kind queues instead of creating threads.
COPIES = "copies"  # memory copies and native transfers: exports, shm reads, NIXL under CMA
CALLS = "calls"  # blocking calls into Ray and the GCS (actor handles, records, anchors), transports' set-up
SHM_READ = "shm-read"  # the second half of a split shm read (shm.SPLIT_READ_BYTES)
SHM_WRITE = "shm-write"  # the other parts of a split copy into a segment (_local.SPLIT_WRITE_BYTES)
# A split copy runs on this many cores: its caller's thread and SHM_WRITE's threads. Ray
# starts workers with OMP_NUM_THREADS=1, so a `copy_` alone uses one core.
COPY_CORES = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
GLOO = "gloo"  # Gloo waits in flight
GROUP = "group"  # collective operations a member serves (each blocks for a whole collective)
ADAPTER = "adapter"  # a Ray TensorTransportManager's blocking receives
ABORTS = "aborts"  # aborting those receives (never queued behind them)
POOLS: dict[str, int] = {
    COPIES: 4, CALLS: 4, SHM_READ: 1, SHM_WRITE: max(1, COPY_CORES - 1), GLOO: 16, GROUP: 8, ADAPTER: 4, ABORTS: 2
}
POOL_SIZE = POOLS[COPIES]

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid: int | None = None


def io_loop() -> asyncio.AbstractEventLoop:
    """Return the I/O loop of this process, starting its thread on first use."""
    global _loop, _thread, _pid
    loop = _loop
    if loop is not None and _pid == os.getpid():
        return loop
    with _lock:
        if _loop is None or _pid != os.getpid():
            ready = threading.Event()
            new_loop = asyncio.new_event_loop()

            def run() -> None:
                asyncio.set_event_loop(new_loop)
                new_loop.call_soon(ready.set)
                new_loop.run_forever()

            _thread = threading.Thread(target=run, name="rdt-io", daemon=True)
            _thread.start()
            ready.wait()
            _loop, _pid = new_loop, os.getpid()
            atexit.register(_shutdown)
        return _loop


def on_io_thread() -> bool:
    """Say whether the caller runs on the I/O loop's thread."""
    return _thread is not None and threading.current_thread() is _thread


_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def declare(purpose: str, threads: int) -> str:
    """Add a pool of at most `threads` threads for `purpose` to POOLS (a transport's own,
    at its import): `pool(purpose)` makes it on first use, and it ends with the others at
    exit. Returns `purpose`. Raises: ValueError if `purpose` has another bound."""
    with _lock:
        if POOLS.setdefault(purpose, threads) != threads:
            raise ValueError(f"pool {purpose!r} has {POOLS[purpose]} threads, not {threads}")
    return purpose


def pool(purpose: str = COPIES) -> concurrent.futures.ThreadPoolExecutor:
    """Return this process's bounded pool for `purpose` (one of POOLS), made on first use."""
    p = _pools.get(purpose)
    if p is None:
        with _lock:
            p = _pools.get(purpose)
            if p is None:
                p = _pools[purpose] = concurrent.futures.ThreadPoolExecutor(
                    POOLS[purpose], thread_name_prefix=f"rdt-{purpose}"
                )
    return p


def prestart(purposes: tuple[str, ...] = (CALLS, COPIES)) -> None:
    """Start the I/O loop and a thread of each pool for `purposes` now (blocking briefly).

    A pool starts a thread inside `submit` when none is idle, and `Thread.start` waits
    until the new thread runs: on a busy host, 100-200 ms for which the submitting loop
    stood still. An `rdt.remote` actor calls this at creation, before its loop serves, so
    that its first transfers find a thread waiting.
    """
    io_loop()
    for purpose in purposes:
        pool(purpose).submit(int).result()


async def to_thread(fn: Callable[..., T], *args: Any, purpose: str = COPIES) -> T:
    """Run a blocking call in the pool for `purpose` and await it from any loop."""
    return await asyncio.get_running_loop().run_in_executor(pool(purpose), fn, *args)


async def shielded(aw: Awaitable[Any], *, timeout: float | None = None) -> bool:
    """Await `aw` to its end, or until `timeout`, through any cancel of the caller.

    Cleanup that must finish (a release, an abort, a receive into the caller's memory)
    runs under it. Returns whether the caller was cancelled meanwhile: it then re-raises
    `CancelledError` once its cleanup is done. What is still running at `timeout` goes on.
    """
    work = asyncio.ensure_future(aw)
    deadline = None if timeout is None else time.monotonic() + timeout
    cancelled = False
    while not work.done():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        try:
            await asyncio.wait({work}, timeout=left)  # never cancels `work`
        except asyncio.CancelledError:
            cancelled = True
    if work.done() and not work.cancelled():
        work.exception()  # retrieved: the caller reads the result where it wants it
    return cancelled


async def to_thread_finished(fn: Callable[..., T], *args: Any, undo: Callable[[T], None] | None = None) -> T:
    """`to_thread` for a call that must not be left running when its caller gives up.

    A blocking call cannot be interrupted: a copy writes memory the caller gets back or
    may reuse (its `into=` buffers), and what a call makes (a registration, a handle)
    would leak. So a cancel takes effect once the call has returned, `undo` gets what it
    made, and the caller's cleanup never runs before it.
    """
    work = asyncio.ensure_future(to_thread(fn, *args))
    cancelled = await shielded(work)
    result = work.result()
    if cancelled:
        if undo is not None:
            undo(result)
        raise asyncio.CancelledError
    return result


async def poll_closely(done: Callable[[], bool], until: float) -> bool:
    """Poll `done()` between this loop's other work (a yield, no sleep: every ~10-20 µs)
    until it holds or `time.perf_counter()` passes `until`; return whether it held.

    For work that ends without this thread within microseconds to a few milliseconds (a
    device copy, a NIXL READ between GPUs): a loop sleep lasts at least 1 ms (epoll's
    granularity) and a hop to a thread and back ~0.3 ms. The loop stays free for its other
    tasks; its thread stays busy, so callers bound `until` and then wait another way.
    """
    while not done():
        if time.perf_counter() >= until:
            return False
        await asyncio.sleep(0)
    return True


# The longest a cancelled coroutine's cleanup is waited for (a transport's abort). A fetch
# given up on past it keeps its `into=` buffers claimed until the transfer lets go.
SETTLE_S = 60.0


class Started(Generic[T]):
    """A coroutine run on the I/O loop: the one way onto it, from any thread or loop.

    Await it (from any loop: the caller's loop is never blocked), or wait for it from a
    plain thread with `result()`. `cancel()` cancels the task; `settle()`/`wait_settled()`
    wait until the coroutine has exited, cleanup and all. `wait()` and `result()` give up
    as a caller expects of a transfer into its memory: cancelled, timed out or interrupted,
    they abort the work and return only once it has let go, so nothing writes the caller's
    buffers afterwards (at most SETTLE_S: past it they return, and the fetch keeps its
    claim on those buffers until the work lets go).
    """

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        """`coro`, not yet running: `launch()` starts it (`start()` does both)."""
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()  # cancelling it cancels the task
        self.settled: concurrent.futures.Future[None] = concurrent.futures.Future()  # set once the coroutine exited
        self.task: asyncio.Task[T] | None = None  # set once it runs
        self._coro: Coroutine[Any, Any, T] | None = coro  # until it runs
        self._launched = False

    def launch(self, *, here: bool = False) -> None:
        """Start the coroutine on the I/O loop; again after a cancel: a no-op if it ran,
        else `settled` is set at once. So a caller interrupted anywhere around the first
        call (Ctrl-C lands between any two bytecodes) cancels `future`, launches again and
        waits for `settled`, knowing nothing runs after that. On the I/O loop the task
        starts in this iteration, with no hop through the loop's self-pipe (~0.1 ms).

        `here`: on the loop running in this thread instead, if there is one (a coroutine
        that never blocks its loop: no hop there and back, ~0.3 ms). Its result is then
        awaited on that loop; `result()` refuses (it would block the loop the work needs).
        """
        if on_io_thread() or (here and not self._launched and running_loop() is not None):
            self._create()
        else:
            io_loop().call_soon_threadsafe(self._create)
        self._launched = True

    def _create(self) -> None:  # on the I/O loop
        coro, self._coro = self._coro, None
        if coro is None:
            return  # it ran (or was closed) already
        fut, settled = self.future, self.settled
        if fut.cancelled():  # (stays PENDING while it runs, so that the caller can cancel it)
            coro.close()
            settled.set_result(None)
            return
        task = asyncio.get_running_loop().create_task(coro)
        self.task = task
        task.add_done_callback(lambda t: _copy_outcome(t, fut, settled))
        fut.add_done_callback(lambda f: f.cancelled() and task.get_loop().call_soon_threadsafe(task.cancel))

    def __await__(self) -> Generator[Any, None, T]:
        """Its result, from any loop; cancelling the await cancels the task (without
        waiting for its cleanup: `wait()` waits)."""
        if self._on_this_loop():
            assert self.task is not None
            return self.task.__await__()  # started on this loop: no wrapping future
        return asyncio.wrap_future(self.future).__await__()

    def _on_this_loop(self) -> bool:
        """Whether the task runs on the loop of this thread (the I/O loop, or the caller's: `launch(here=True)`)."""
        task = self.task
        return task is not None and task.get_loop() is running_loop()

    async def wait(self) -> T:
        """Await the result; cancelling this await cancels the work and returns once it
        has let go (at most `SETTLE_S`). Any other failure cancels what is left of the work."""
        try:
            if self._on_this_loop():
                assert self.task is not None
                # Shielded: each cancel of this await would reach the task's own cleanup.
                return await asyncio.shield(self.task)
            return await self
        except asyncio.CancelledError:
            self.cancel()  # (awaiting it from another loop cancelled it already)
            await shielded(self.settle())
            raise
        except BaseException:
            self.cancel()
            raise

    def result(self, timeout: float | None = None) -> T:
        """Wait for the result from a thread that runs no event loop (starting the coroutine
        if it was not). On `timeout` (`TimeoutError`) or an interrupt (Ctrl-C), the work is
        cancelled and waited for until it has let go (at most `SETTLE_S`), then it raises."""
        fut = self.future
        if self._on_this_loop() and not fut.done():
            raise RuntimeError("this transfer runs on this thread's event loop: await it; result() would block that loop")
        try:
            if not self._launched:
                self.launch()  # inside the try: a Ctrl-C landing around it is handled below
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # (it ended as the wait gave up)
                return fut.result()
            fut.cancel()
            self._settle_through_interrupts()
            raise
        except BaseException:  # Ctrl-C (KeyboardInterrupt), or any other way out of the wait
            if not fut.done():
                fut.cancel()
                self.launch()  # if the interrupt came before it was launched: it settles at once
                self._settle_through_interrupts()
            raise
        finally:
            del fut  # the future holds the error, whose traceback holds this frame: break the cycle

    def _settle_through_interrupts(self) -> None:
        """`wait_settled(SETTLE_S)`, through further interrupts (a second Ctrl-C while a
        cancelled transfer lets go): the work writes the caller's memory until it settles,
        so returning at the second interrupt handed back buffers still being written. An
        interrupt that came meanwhile is raised once it settled (or SETTLE_S passed)."""
        deadline = time.monotonic() + SETTLE_S
        interrupted: BaseException | None = None
        while True:
            try:
                self.wait_settled(max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
                if time.monotonic() >= deadline:
                    break
        if interrupted is not None:
            raise interrupted

    def cancel(self) -> bool:
        """Cancel the work; what it held is released on the I/O loop."""
        return self.future.cancel()

    def done(self) -> bool:
        return self.future.done()

    def wait_settled(self, timeout: float) -> bool:
        """Wait (from a thread) until the coroutine has exited; False on timeout."""
        try:
            self.settled.result(timeout)
            return True
        except concurrent.futures.TimeoutError:
            return False

    async def settle(self, timeout: float = SETTLE_S) -> bool:
        """Await (from any loop) until the coroutine has exited; False on timeout."""
        waited: asyncio.Future[Any] = (
            self.task if self.task is not None and self._on_this_loop() else asyncio.wrap_future(self.settled)
        )
        done, _ = await asyncio.wait({waited}, timeout=timeout)
        return bool(done)


def start(coro: Coroutine[Any, Any, T]) -> Started[T]:
    """Run a coroutine on the I/O loop: `await` the result from any loop, `.result()` from
    a thread, `.cancel()` to cancel it (see `Started`)."""
    started = Started(coro)
    started.launch()
    return started


def _copy_outcome(task: asyncio.Task[T], fut: concurrent.futures.Future[T], settled: concurrent.futures.Future[None]) -> None:
    if task.cancelled():
        fut.cancel()
    elif fut.set_running_or_notify_cancel():  # False if the caller cancelled it meanwhile
        exc = task.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(task.result())
    else:
        task.exception()  # retrieved: the caller gave up on it
    settled.set_result(None)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """Return the loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def set_once(fut: asyncio.Future[None]) -> None:
    """Wake a waiter: set `fut`'s result unless it is done already (woken, or cancelled)."""
    if not fut.done():
        fut.set_result(None)


def call_soon(fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on the I/O loop from any thread (O(1), never blocks)."""
    io_loop().call_soon_threadsafe(fn, *args)


# -- finalizers --------------------------------------------------------------------------

_finalized: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
_settle_due = False
_settling = threading.RLock()  # never taken in a finalizer


def finalize(obj: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` once `obj` is gone, as `weakref.finalize`, but never inside the finalizer.

    A finalizer runs where the last reference goes, or inside any allocation of any thread
    when the cyclic GC collects: also in a thread that holds the very lock `fn` takes, which
    would deadlock. So the finalizer only queues `fn` (a deque append takes no lock); the
    I/O loop runs it soon after, and `settle()` runs what is queued at once: call it,
    holding no lock, before reading state that such an `fn` changes. Nothing runs at exit.
    """
    weakref.finalize(obj, _queue, fn, args).atexit = False


def _queue(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:  # in a finalizer: no locks
    global _settle_due
    _finalized.append((fn, args))
    loop = _loop
    if _settle_due or loop is None or _pid != os.getpid():
        return  # one is coming, or no loop to run it yet: the next settle() runs it
    _settle_due = True
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed: the interpreter is ending
        pass


def settle() -> None:
    """Run the work finalizers queued; when it returns, all that was queued before has run
    (any thread; hold no lock that such work takes)."""
    global _settle_due
    with _settling:  # another thread's drain finishes what it took first
        _settle_due = False  # before draining: what is queued meanwhile schedules another
        while True:
            try:
                fn, args = _finalized.popleft()
            except IndexError:
                return
            try:
                fn(*args)
            except Exception:
                log.exception("rdt_async: %s after its object was gone", getattr(fn, "__qualname__", fn))


def _shutdown() -> None:
    loop = _loop
    for p in list(_pools.values()):
        p.shutdown(wait=False, cancel_futures=True)
    if loop is not None and _pid == os.getpid() and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


def _forked() -> None:
    """In a forked child: the parent's pools have no threads here (work given them would
    never run), a lock may be held by a thread that is not here, and the finalizers queued
    are the parent's to run. Start afresh; the I/O loop starts anew at first use."""
    global _lock, _pools, _settling, _settle_due
    _lock = threading.Lock()
    _pools = {}
    _settling = threading.RLock()
    _settle_due = False
    _finalized.clear()


os.register_at_fork(after_in_child=_forked)
