"""The per-process I/O loop thread, a bounded pool for native waits, and loop bridging.

Every transfer of a process runs as a task on one event loop owned by rdt_async (the
I/O loop). Callers on other loops get an asyncio future completed with
`call_soon_threadsafe`; blocking callers wait on a `concurrent.futures.Future`.
Nothing here starts before it is first used.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Native calls that block (copies, Gloo waits, NIXL transfers under CMA) share this many
# threads per process; more in-flight work queues instead of creating threads.
POOL_SIZE = 4

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


def pool(name: str = "pool", size: int = POOL_SIZE) -> concurrent.futures.ThreadPoolExecutor:
    """Return this process's bounded pool `name` (blocking native calls), made on first use."""
    p = _pools.get(name)
    if p is None:
        with _lock:
            p = _pools.get(name)
            if p is None:
                p = _pools[name] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix=f"rdt-{name}")
    return p


async def to_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in the bounded pool and await it from any loop."""
    return await asyncio.get_running_loop().run_in_executor(pool(), fn, *args)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run a coroutine on the I/O loop; cancelling the returned future cancels it."""
    return asyncio.run_coroutine_threadsafe(coro, io_loop())


def start(coro: Coroutine[Any, Any, T]) -> tuple[concurrent.futures.Future[T], asyncio.Task[T] | None]:
    """`submit`, and the task itself when the caller runs on the I/O loop.

    On the I/O loop the task starts in this iteration, with no hop through the loop's
    self-pipe, and awaiting it there needs no wrapping future (~0.1 ms saved per hop).
    """
    chain = getattr(asyncio.futures, "_chain_future", None)  # what run_coroutine_threadsafe uses
    if chain is None or not on_io_thread():
        return submit(coro), None
    task = asyncio.get_running_loop().create_task(coro)
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()
    chain(task, fut)
    return fut, task


def run_io(coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Run a coroutine on the I/O loop and return an awaitable for the caller's loop.

    Runs on: the caller's loop. Awaiting it never blocks that loop; cancelling it
    cancels the task on the I/O loop, whose cleanup then runs there.
    """
    if on_io_thread():
        return asyncio.ensure_future(coro)
    return asyncio.wrap_future(submit(coro))


def running_loop() -> asyncio.AbstractEventLoop | None:
    """Return the loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def call_soon(fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on the I/O loop from any thread (O(1), never blocks)."""
    io_loop().call_soon_threadsafe(fn, *args)


def _shutdown() -> None:
    loop = _loop
    for p in list(_pools.values()):
        p.shutdown(wait=False, cancel_futures=True)
    if loop is not None and _pid == os.getpid() and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)

