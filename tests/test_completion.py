"""The polled completion path (NCCL's on GPU), driven here by real Gloo works on CPU."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rdt_async.transports.gloo import poll_works


@pytest.fixture(scope="module")
def pgs():
    # Port 0: the store binds a port the kernel picks, so no other process can take it
    # between a pick and the bind (two test workers raced for one before).
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = store.port
    out: dict[int, object] = {}

    def join(rank: int) -> None:
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        out[rank] = dist.ProcessGroupGloo(dist.PrefixStore("poll", client), rank, 2, opts)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    yield out[0], out[1]
    for pg in out.values():
        pg.shutdown()


# Gloo's point-to-point works complete only inside wait(); its collectives complete on
# Gloo's own threads and report it through is_completed(), as NCCL works do through
# their CUDA events. So collectives stand in for NCCL here.


async def test_polling_waits_for_the_peer_and_never_blocks_the_loop(pgs):
    first, second = pgs
    a = torch.arange(1 << 20, dtype=torch.float32)
    b = torch.ones(1 << 20)
    work_b = second.allreduce([b])
    task = asyncio.ensure_future(poll_works([work_b]))
    ticks = 0
    for _ in range(20):  # the loop keeps running while the peer has not joined
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 20 and not task.done()
    work_a = first.allreduce([a])
    async with asyncio.timeout(30):
        await asyncio.gather(task, poll_works([work_a]))
    want = torch.arange(1 << 20, dtype=torch.float32) + 1
    assert torch.equal(a, want) and torch.equal(b, want)


async def test_polling_many_works_at_once(pgs):
    first, second = pgs
    xs = [torch.full((1000 + i,), float(i)) for i in range(8)]
    ys = [torch.full((1000 + i,), 10.0 * i) for i in range(8)]
    works_x = [first.allreduce([x]) for x in xs]
    works_y = [second.allreduce([y]) for y in ys]
    async with asyncio.timeout(30):
        await asyncio.gather(poll_works(works_x), *(poll_works([w]) for w in reversed(works_y)))
    assert [float(x[0]) for x in xs] == [11.0 * i for i in range(8)]
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))
