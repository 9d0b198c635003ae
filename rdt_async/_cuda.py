"""CUDA stream order at the edges of a transfer.

Transfers read and write device memory outside the streams that compute it: a NIXL
READ copies with UCX's own streams, a send is posted from an `rdt` thread whose
current stream is not the producer's. So the two ends meet stream order here:

- a producer's tensors are complete before any transport may read them: what the
  producing thread's current streams had queued when the method returned has run;
- a consumer's destination is idle before a transfer writes it: what the fetching
  thread's current streams had queued (kernels still using caller buffers, or the
  previous use of memory the caching allocator hands out again) has run.

Both wait on events recorded on the current stream of the thread that knows the
streams: blocking where that thread may block, polled with backoff on a loop. On a
process with no CUDA tensor in sight nothing here touches CUDA.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

POLL_FIRST_S, POLL_CAP_S = 50e-6, 5e-3
T = TypeVar("T")


def record(tensors: Iterable[torch.Tensor]) -> list[torch.cuda.Event]:
    """Record an event on this thread's current stream of each CUDA device among `tensors`.

    Cheap and non-blocking; returns [] when no tensor is on a CUDA device.
    """
    devices = {t.device for t in tensors if t.is_cuda}
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def wait_blocking(events: Iterable[torch.cuda.Event]) -> None:
    """Block this thread until every event has fired (for threads that may block)."""
    for event in events:
        event.synchronize()


async def poll(
    items: Iterable[T], done: Callable[[T], bool], *, first: float = POLL_FIRST_S, cap: float = POLL_CAP_S
) -> None:
    """Wait until `done(item)` holds for every item, polling with backoff: the loop stays free."""
    pending = list(items)
    delay = first
    while pending:
        pending = [x for x in pending if not done(x)]
        if pending:
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)


async def wait(events: Iterable[torch.cuda.Event]) -> None:
    """Wait until every event has fired, polling with backoff: the loop stays free."""
    await poll(events, lambda e: e.query())


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Block until this thread's own queued work on `tensors`' devices has run.

    For rdt's pool threads after they copy into device memory: the caller's streams do
    not order against a pool thread's stream, so the copy must be finished on return.
    """
    wait_blocking(record(tensors))


def settled(fn: Callable[..., list[torch.Tensor]], *args: Any) -> list[torch.Tensor]:
    """Run `fn` (a copy into memory, in the pool) and return its tensors once settled."""
    out = fn(*args)
    settle(out)
    return out
