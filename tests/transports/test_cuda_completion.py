"""The completion path of NCCL works, on a real GPU: CUDA events polled from a loop.

One GPU cannot run NCCL between two ranks, so a work here is what `poll_works` needs
of one: `is_completed()` from a CUDA event, `wait()` ordering the current stream after
it. Skipped without CUDA; the GPU machine runs it with the contract suite.
"""

from __future__ import annotations

import time

import pytest
import torch
from probes import LagProbe

from rdt_async import _cuda
from rdt_async.transports.gloo import poll_works

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class EventWork:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


async def test_cuda_events_complete_without_blocking_the_loop():
    side = torch.cuda.Stream()
    xs = [torch.zeros(1 << 22, device="cuda") for _ in range(4)]
    works = []
    with torch.cuda.stream(side):
        for i, x in enumerate(xs):
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time per work
            x.fill_(float(i + 1))
            works.append(EventWork(side))
    assert not works[-1].is_completed()
    probe = LagProbe()
    probe.start()
    t0 = time.perf_counter()
    await poll_works(list(reversed(works)))
    took = time.perf_counter() - t0
    lag = await probe.stop()
    assert all(w.is_completed() for w in works)
    sums = [float((x * 2).sum()) for x in xs]  # the current stream now runs after the side stream
    assert sums == [2.0 * (i + 1) * (1 << 22) for i in range(4)]
    assert took > 0.01 and lag < 0.05, (took, lag)


async def test_stream_order_waits_for_the_current_stream_without_blocking_the_loop():
    # `_cuda.record` takes the *current* stream of this thread (a side stream here), and
    # `_cuda.wait` returns once what was queued on it has run, with the loop free.
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        x.fill_(5.0)
        events = _cuda.record([x, torch.ones(3)])  # the CPU tensor adds no event
    assert len(events) == 1 and not events[0].query() and not side.query()
    probe = LagProbe()
    probe.start()
    await _cuda.wait(events)
    lag = await probe.stop()
    assert side.query() and lag < 0.05, lag
    assert float(x.sum()) == 5.0 * (1 << 22)


def test_settle_blocks_until_this_threads_work_has_run():
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.fill_(2.0)
        _cuda.settle([x])
    assert side.query()
    assert _cuda.record([torch.ones(2)]) == []  # CPU tensors: nothing to wait for


def test_fetched_tensors_land_on_a_device_this_process_has():
    from rdt_async.transports._kit import local_device

    assert local_device("cuda:0") == torch.device("cuda", 0)
    n = torch.cuda.device_count()
    assert local_device(f"cuda:{n}") == torch.device("cuda", torch.cuda.current_device())  # the producer's 9th GPU
    assert local_device("cpu") == torch.device("cpu")
