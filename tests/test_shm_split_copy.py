"""shm's copy into a segment, split across threads from SPLIT_WRITE_BYTES on: every byte
arrives, whatever the tensors' sizes, dtypes, strides, and whether the pool is free."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray
import torch

import rdt_async as rdt
from rdt_async import _io, _local
from rdt_async.testing import roundtrip
from rdt_async.transports import shm


def odd_tensors(seed: int) -> list[torch.Tensor]:
    """Tensors whose bytes a split copy could get wrong: odd sizes (cut mid-element and
    mid-row), non-contiguous ones, empty ones, 0-d ones, lazy conjugates and negations,
    several dtypes; over SPLIT_WRITE_BYTES in all."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn((1 << 22) + 7, generator=g)  # 16 MiB + 28 bytes: alone over the threshold
    rows = torch.randint(0, 1 << 30, (1001, 777), generator=g, dtype=torch.int64)
    return [
        big,
        torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8)[1:],  # odd length, odd offset
        rows.t(),  # non-contiguous: split along its first dimension
        rows[::3, 1::2],  # strided both ways
        torch.randn(5, 0, 3, generator=g),  # empty
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
        torch.randn(333, 1025, generator=g, dtype=torch.float64).to(torch.bfloat16),
        torch.randint(0, 2, (1 << 20,), generator=g).bool(),
        torch.randn(70001, generator=g, dtype=torch.complex64).conj().resolve_conj(),
        torch.randint(-(1 << 15), 1 << 15, (4097,), generator=g, dtype=torch.int16),
        torch.tensor(1 - 2j, dtype=torch.complex64).conj(),  # a lazy conjugate, 0-d, as `prepare` may get it
        torch.randn(3001, generator=g, dtype=torch.complex64).conj().imag,  # a lazy negation, strided
    ]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    for g, w in zip(got, want):
        assert torch.equal(g, w.resolve_conj().resolve_neg()), (w.shape, w.dtype)


def test_the_threshold_and_cores_split_the_copies_tested_here():
    assert odd_tensors(0)[0].nbytes > _local.SPLIT_WRITE_BYTES
    assert 1 <= _io.COPY_CORES <= 4 and _io.POOLS[_io.SHM_WRITE] == max(1, _io.COPY_CORES - 1)


@pytest.mark.parametrize("parts", [2, 3, 4, 7])
def test_the_parts_cover_every_byte_once_in_about_equal_shares(parts):
    import mmap

    values = odd_tensors(1)
    offsets, size = shm.aligned_layout((t.nbytes for t in values), shm.ALIGN)
    mm = mmap.mmap(-1, size)
    cut = _local._parts(mm, values, offsets, parts)
    assert len(cut) == parts
    shares = [sum(d.nbytes for d, _ in p) for p in cut]
    assert sum(shares) == sum(t.nbytes for t in values)
    cut_at = max(t.nbytes // t.shape[0] for t in values if t.dim() and t.numel() and not t.is_contiguous())
    assert max(shares) - min(shares) <= parts * max(cut_at, 4096)  # each cut at a row or a page
    for p in cut:
        _local._copy_part(p)
    assert cut == [[]] * parts  # the views of the mapping are dropped as they are copied
    got = [
        torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape) if t.numel() else t
        for t, o in zip(values, offsets)
    ]
    same(got, values)
    del got, cut
    mm.close()


def test_a_split_export_arrives_exact_through_a_segment():
    values = odd_tensors(2)
    same(asyncio.run(roundtrip(shm.ShmTransport(), values, obj_id="split-copy")), values)
    one = [odd_tensors(3)[0]]  # one tensor over the threshold, fetched into a buffer
    into = [torch.zeros_like(one[0])]
    same(asyncio.run(roundtrip(shm.ShmTransport(), one, buffers=into, obj_id="split-copy-into")), one)


def test_a_publisher_s_copy_into_its_slot_is_split_and_exact(monkeypatch):
    # A publisher's slot is shm's twin (warm shared memory): its copy is split the same way.
    from rdt_async import _publish

    values = [t.resolve_conj().resolve_neg() for t in odd_tensors(3)]  # (publish takes dense tensors)
    state = {f"t{i}": t for i, t in enumerate(values)}
    entries, size = _publish._layout(state)
    slot = _publish._Slot(entries, size)
    assert size >= _local.SPLIT_WRITE_BYTES
    split = []
    real = _local._copy_split
    monkeypatch.setattr(_local, "_copy_split", lambda *a: split.append(1) or real(*a))
    _publish._copy(slot, state)
    assert split == ([1] if _io.COPY_CORES > 1 else [])
    same([slot.views[k] for k in state], values)
    for t in values:  # written again: the new values, not the old ones
        if t.numel() and t.dtype.is_floating_point:
            t.add_(1)
    _publish._copy(slot, state)
    same([slot.views[k] for k in state], values)


def test_a_busy_write_pool_never_holds_an_export_up():
    """The pool's threads are all busy (other exports): the caller copies every part itself."""
    if _io.COPY_CORES < 2:
        pytest.skip("one core: copies are never split")
    release = threading.Event()
    busy = [_io.pool(_io.SHM_WRITE).submit(release.wait, 60) for _ in range(_io.POOLS[_io.SHM_WRITE])]
    try:
        values = odd_tensors(4)
        start = time.monotonic()
        got = asyncio.run(roundtrip(shm.ShmTransport(), values, obj_id="split-copy-busy"))
        assert time.monotonic() - start < 30
        same(got, values)
    finally:
        release.set()
        for f in busy:
            f.result()


@rdt.remote
class Producer:
    def __init__(self, seed: int) -> None:
        self.values = odd_tensors(seed)  # kept plain (not share_memory_()): copied at each return

    @rdt.method(tensor_transport="shm")
    def publish(self):
        return self.values

    @rdt.method
    def publish_auto(self):
        return {"values": self.values}


@rdt.remote
class Consumer:
    async def fetch(self, value) -> list[torch.Tensor]:  # fetched as the call's argument
        return [t.clone() for t in (value if isinstance(value, list) else value["values"])]


@pytest.mark.usefixtures("ray_session")
def test_a_kept_tensor_returned_by_an_actor_arrives_exact():
    p, c = Producer.remote(7), Consumer.remote()
    try:
        want = odd_tensors(7)
        for method in (p.publish, p.publish_auto, p.publish):  # a warm segment the second time
            same(ray.get(c.fetch.remote(method.remote())), want)
    finally:
        ray.kill(p)
        ray.kill(c)


def test_byte_ranges_are_copied_by_memmove_and_the_rest_by_copy(monkeypatch):
    """Contiguous tensors' parts go through libc's memmove (its non-temporal stores past
    the cache's size); strided ones, lazy conjugates and negations through `copy_`."""
    import ctypes
    import mmap

    moved: list[int] = []
    real = ctypes.memmove

    def counted(dst: int, src: int, n: int) -> int:
        moved.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", counted)
    values = odd_tensors(5)
    offsets, size = shm.aligned_layout((t.nbytes for t in values), shm.ALIGN)
    mm = mmap.mmap(-1, size)
    for p in _local._parts(mm, values, offsets, 3):
        _local._copy_part(p)
    contiguous = sum(t.nbytes for t in values if t.is_contiguous() and not (t.is_conj() or t.is_neg()))
    assert sum(moved) == contiguous and len(moved) >= 3  # the big tensor cut in three
    got = [
        torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape) if t.numel() else t
        for t, o in zip(values, offsets)
    ]
    same(got, values)
    del got
    mm.close()


def _copy_timed(part: list, started: threading.Event, span: list[float]) -> None:
    started.set()
    time.sleep(0.01)  # the other thread spins first
    span.append(time.perf_counter())
    _local._copy_part(part)
    span.append(time.perf_counter())


def test_a_part_is_copied_with_the_gil_released():
    """Another thread runs Python while a part's memmove runs (an actor's loop stays free):
    it never waits as long as half the copy for its next step."""
    import itertools
    import mmap

    src = torch.full((256 << 20,), 7, dtype=torch.uint8)
    mm = mmap.mmap(-1, src.numel())
    dst = torch.frombuffer(mm, dtype=torch.uint8)
    tries = []
    for _ in range(3):  # (a loaded machine may keep this thread off its core for a while)
        started, span = threading.Event(), []
        worker = threading.Thread(target=_copy_timed, args=([(dst, src)], started, span))
        worker.start()
        started.wait()
        ticks = []
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
        gap = max(b - a for a, b in itertools.pairwise(ticks))
        tries.append((round(gap * 1e3, 1), round((span[1] - span[0]) * 1e3, 1)))
        if gap < (span[1] - span[0]) / 2:
            break
    assert tries[-1][0] < tries[-1][1] / 2, f"(longest wait, copy) ms: {tries}"
    assert torch.equal(dst[-4096:], src[-4096:])
    del dst
    mm.close()


def test_many_small_tensors_are_copied_on_one_thread_exactly_and_the_mapping_can_close_after(monkeypatch):
    # Split across threads, thousands of small copies handed the GIL back and forth at
    # each one (a state dict of 10,000 tensors of 4 KiB: 164 ms split, 19 ms on one thread).
    import mmap

    small = [odd_tensors(6)[i] for i in (4, 5, 9, 10, 11)]  # empty, 0-d, odd size, lazy conjugate and negation
    small.append(torch.arange(64, dtype=torch.int32).view(8, 8).t())  # non-contiguous
    values = small * 1000  # 6,000 tensors
    values += odd_tensors(7)[:1]  # and one large: over SPLIT_WRITE_BYTES in all, small on average
    offsets, size = shm.aligned_layout((t.nbytes for t in values), shm.ALIGN)
    assert size > _local.SPLIT_WRITE_BYTES and size < _local.SPLIT_MEAN_BYTES * len(values)
    monkeypatch.setattr(_local, "_copy_split", lambda *a: pytest.fail("split"))
    mm = mmap.mmap(-1, size)
    _local.copy_to(mm, values, offsets)
    got = [
        torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape) if t.numel() else t
        for t, o in zip(values, offsets)
    ]
    same(got, values)
    del got
    mm.close()  # (no export of it outlives the copy)
    short = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="a tensor reaches past the 4096 bytes it is copied into"):
        _local.copy_to(short, [torch.ones(1000), torch.ones(100)], [0, 4000])
    assert short[:] == bytes(4096)  # refused before anything was written
    short.close()


def test_views_of_one_shared_storage_read_into_buffers_open_it_once(monkeypatch):
    # Each view opened the producer's storage again (a /proc lookup and a check of its
    # key, then an open): a state dict of 10,000 views of a publisher's slot, 10,000 opens.
    base = torch.arange(200 * 8192, dtype=torch.float32).share_memory_()
    assert base.untyped_storage().nbytes() >= shm.SHARE_MIN_BYTES
    values = [base[i * 8192 : (i + 1) * 8192] for i in range(200)]
    opens = []
    real = shm._open_shared
    monkeypatch.setattr(shm, "_open_shared", lambda *a: opens.append(1) or real(*a))
    into = [torch.zeros(8192) for _ in values]
    same(asyncio.run(roundtrip(shm.ShmTransport(), values, buffers=into, obj_id="views-of-one")), values)
    assert all(torch.equal(b, v) for b, v in zip(into, values)) and len(opens) == 1
