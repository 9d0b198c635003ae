"""Two fetches of one process never write the same `into=` bytes at once: the second waits
for the first to end (`_buffers.Writes`). Unit tests of the claims, no cluster; the fetch
that waits, end to end, is in test_into_buffers.py.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
import torch

from rdt_async import _buffers
from rdt_async.transports._base import TensorSpec


def _writes(*bufs: torch.Tensor) -> _buffers.Writes:
    specs = [TensorSpec.of(b) for b in bufs]
    got, writes = _buffers.checked_writes(specs, list(bufs))
    assert got is not None and writes is not None
    return writes


def test_fetches_into_disjoint_bytes_claim_at_once_and_into_shared_bytes_do_not():
    model = torch.zeros(1 << 16)
    first, second = model[: 1 << 15], model[1 << 15 :]
    a = _writes(first)
    assert a.claim_nowait() and a.claim_nowait()  # (a claim held: claimed again at once)
    b = _writes(second, torch.zeros(4))  # the other half of one storage: no byte shared
    assert b.claim_nowait()
    c = _writes(torch.zeros(4), model[(1 << 15) - 1 : (1 << 15) + 1])  # one byte of each half
    assert not c.claim_nowait()
    a.release()
    assert not c.claim_nowait()  # b still writes the second half
    b.release()
    assert c.claim_nowait()
    c.release()
    c.release()  # (idempotent)
    assert _writes(model).claim_nowait()


def test_a_strided_view_and_a_parameter_claim_the_bytes_they_reach():
    base = torch.zeros(100)
    evens = _writes(base[::2])  # reaches bytes 0 .. 99 * 4: the odd elements lie between
    assert evens.claim_nowait()
    assert not _writes(base[1:2]).claim_nowait()  # (bytes within its reach are claimed)
    assert _writes(torch.zeros(3)).claim_nowait()
    evens.release()
    p = torch.nn.Parameter(torch.zeros(8))
    w = _writes(p)
    assert w.claim_nowait()
    assert not _writes(p.detach()[2:4]).claim_nowait()
    w.release()


async def test_a_second_fetch_into_the_same_buffers_waits_for_the_first_to_end():
    buf = torch.zeros(1024)
    first, second = _writes(buf), _writes(buf)
    assert first.claim_nowait()
    waiting = asyncio.ensure_future(second.claim())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the first still writes
    first.release()
    await asyncio.wait_for(waiting, 5)
    third = _writes(buf[10:20])
    assert not third.claim_nowait()
    second.release()
    assert third.claim_nowait()
    third.release()


async def test_a_waiter_cancelled_leaves_nothing_claimed_and_a_release_from_another_thread_wakes_one():
    buf = torch.zeros(64)
    first = _writes(buf)
    assert first.claim_nowait()
    cancelled = asyncio.ensure_future(_writes(buf).claim())
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    later = _writes(buf)
    waiting = asyncio.ensure_future(later.claim())
    await asyncio.sleep(0.01)
    threading.Thread(target=first.release).start()  # fetches end on the I/O loop's thread too
    await asyncio.wait_for(waiting, 5)
    assert not _writes(buf).claim_nowait()
    later.release()
    assert _writes(buf).claim_nowait()  # (the cancelled one claimed nothing)


def test_a_fetch_dropped_unstarted_lets_its_bytes_go():
    buf = torch.zeros(64)
    dropped = _writes(buf)
    assert dropped.claim_nowait()
    del dropped
    gc.collect()
    again = _writes(buf)
    assert again.claim_nowait()
    again.release()


def test_which_tensors_share_memory_is_found_as_a_pass_over_all_pairs_finds_it():
    # Views of one storage at random places (some overlapping, some inside others) against
    # others, and a tensor of another storage: the index (`_Reach`) against every pair.
    import random

    rng = random.Random(7)
    base = torch.zeros(4096)
    other = torch.zeros(64)

    def view() -> torch.Tensor:
        start = rng.randrange(4096)
        return base[start : start + rng.randrange(0, 40)]

    for _ in range(200):
        a, b = [view() for _ in range(rng.randrange(1, 12))], [view() for _ in range(rng.randrange(1, 12))] + [other]
        spans = [_buffers._span(t) for t in b]
        index = _buffers._Reach(spans)
        for t in a:
            want = {j for j, s in enumerate(spans) if _buffers.overlap(_buffers._span(t), s)}
            assert set(index.sharing(_buffers._span(t))) == want, (t.storage_offset(), t.numel())
        assert _buffers.share(a, b) == any(_buffers.overlap(_buffers._span(x), s) for x in a for s in spans)
    assert not _buffers.share([other[:0]], [other])  # no bytes: shares none


def test_a_same_process_fetch_into_ten_thousand_tensors_is_checked_without_a_pass_over_every_pair():
    # Asking each buffer against each tensor took minutes here (10,000 x 10,000 pairs): a
    # mixture-of-experts state dict fetched into its own model, and a lent publish's check.
    tensors = list(torch.zeros(10_000, 16).unbind())
    buffers = list(torch.zeros(10_000, 16).unbind())
    start = time.monotonic()
    _buffers.check_apart(tensors, tensors)  # its own tensors: allowed
    _buffers.check_apart(buffers, tensors)
    assert not _buffers.share(buffers, tensors) and _buffers.share(buffers, buffers[-1:])
    assert time.monotonic() - start < 20  # (a hang guard: a second or less; a pass over all pairs: minutes)
    with pytest.raises(ValueError, match="into= tensor 9998 shares memory with tensor 9999 "):
        _buffers.check_apart([*tensors[:9998], tensors[9999], tensors[9999]], tensors)


def test_a_refusal_about_thousands_of_tensors_names_a_few():
    # A message listed every tensor: 10,000 specs (or names) in one line of a log.
    from rdt_async import _publish

    specs = [TensorSpec((4,), torch.float32, "cpu", 16)] * 10_000
    with pytest.raises(ValueError) as refused:
        _buffers.checked(specs, [torch.zeros(4)] * 3)
    said = str(refused.value)
    assert said.startswith("into= holds 3 tensor(s) but the object has 10000: float32[4]@cpu, ")
    assert said.endswith(", ... (10000 in all)") and len(said) < 400, said
    old = [_publish._Entry(f"l{i}", (4,), torch.float32, 0, 16) for i in range(10_000)]
    said = _publish._difference(old, old[:1])
    assert said.startswith("names differ from the first version's (missing ['l1', 'l10', 'l100', ")
    assert said.endswith(", ... (9999 in all)], new [])") and len(said) < 400, said
