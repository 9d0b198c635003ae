"""Receive buffers: reuse after the last view is dropped, bounded cache, idle unmapping."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from rdt_async import _alloc, _io

MIB = 1 << 20


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    gc.collect()
    _io.settle()  # buffers dropped before the test go back to the cache now, not during it
    monkeypatch.setattr(_alloc, "_free", {})
    monkeypatch.setattr(_alloc, "_cached", 0)
    yield
    gc.collect()
    _io.settle()


def test_buffers_have_the_asked_shape_dtype_and_hold_values():
    t = _alloc.empty((3, 1 << 18), torch.float32)  # 3 MiB: from the cache path
    assert t.shape == (3, 1 << 18) and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    t.copy_(torch.arange(3 << 18, dtype=torch.float32).view(3, -1))
    assert float(t.sum()) == float(torch.arange(3 << 18, dtype=torch.float64).sum())
    small = _alloc.empty((5,), torch.int64)
    assert small.shape == (5,) and small.dtype == torch.int64


def test_a_dropped_buffer_is_reused_for_the_same_size_class():
    a = _alloc.empty((3 * MIB,), torch.uint8)
    ptr = a.data_ptr()
    del a
    assert _alloc.cached_bytes() == 4 * MIB  # rounded up to the 2 MiB class
    b = _alloc.empty((MIB, 4), torch.uint8)  # 4 MiB: same class
    assert b.data_ptr() == ptr and _alloc.cached_bytes() == 0


def test_a_cpu_device_object_takes_the_cache_too():
    a = _alloc.empty((3 * MIB,), torch.uint8, torch.device("cpu"))  # as transports pass it
    ptr = a.data_ptr()
    del a
    assert _alloc.cached_bytes() == 4 * MIB
    b = _alloc.empty((3 * MIB,), torch.uint8, torch.device("cpu"))
    assert b.data_ptr() == ptr and _alloc.cached_bytes() == 0


def test_a_live_view_keeps_its_buffer_out_of_the_cache():
    a = _alloc.empty((2 * MIB,), torch.uint8)
    view = a[10:20]
    view.fill_(7)
    del a
    assert _alloc.cached_bytes() == 0
    other = _alloc.empty((2 * MIB,), torch.uint8)
    other.fill_(1)
    assert int(view.sum()) == 70  # a new receive never lands in a buffer still in use
    del view
    assert _alloc.cached_bytes() == 2 * MIB


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_alloc, "CACHE_BYTES", 4 * MIB)
    bufs = [_alloc.empty((2 * MIB,), torch.uint8) for _ in range(3)]
    del bufs
    assert _alloc.cached_bytes() == 4 * MIB


def test_idle_buffers_are_unmapped(monkeypatch):
    monkeypatch.setattr(_alloc, "IDLE_S", 0.2)
    monkeypatch.setattr(_alloc, "_sweep_due", False)
    a = _alloc.empty((2 * MIB,), torch.uint8)
    del a
    assert _alloc.cached_bytes() == 2 * MIB
    deadline = time.monotonic() + 10
    while _alloc.cached_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alloc.cached_bytes() == 0


def test_a_reused_buffer_holds_its_own_bytes_only_not_an_earlier_receives():
    """A buffer is a whole size class (2 MiB steps); a tensor's storage is its own bytes, so
    the rest (an earlier receive's, maybe another object's) leaks through no save or pickle."""
    import io
    import pickle

    a = _alloc.empty((2 * MIB,), torch.uint8)
    a.fill_(0x53)  # an earlier receive: another object's bytes
    ptr = a.data_ptr()
    del a
    t = _alloc.empty((MIB + 64,), torch.uint8)  # the same class: the same memory
    t.fill_(0x41)
    assert t.data_ptr() == ptr and t.untyped_storage().nbytes() == MIB + 64
    saved = io.BytesIO()
    torch.save(t, saved)
    assert len(saved.getvalue()) < MIB + 4096 and b"S" * 64 not in saved.getvalue()
    assert len(pickle.dumps(t)) < MIB + 4096
    with pytest.raises(RuntimeError, match="not resizable"):  # as documented: it cannot grow
        t.resize_(2 * MIB)
