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
from collections.abc import Iterable

import torch

POLL_FIRST_S, POLL_CAP_S = 50e-6, 5e-3


def record(tensors: Iterable[torch.Tensor]) -> list[torch.cuda.Event]:
    """Record an event on this thread's current stream of each CUDA device among `tensors`.

    Cheap and non-blocking; returns [] when no tensor is on a CUDA device.
    """
    devices = {t.device for t in tensors if t.device.type == "cuda"}
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


async def wait(events: Iterable[torch.cuda.Event]) -> None:
    """Wait until every event has fired, polling with backoff: the loop stays free."""
    pending = list(events)
    delay = POLL_FIRST_S
    while pending:
        pending = [e for e in pending if not e.query()]
        if pending:
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_CAP_S)


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Block until this thread's own queued work on `tensors`' devices has run.

    For rdt's pool threads after they copy into device memory: the caller's streams do
    not order against a pool thread's stream, so the copy must be finished on return.
    """
    wait_blocking(record(tensors))
