"""shm lends a shared storage (`share_memory_()`) through a descriptor of its own: a
consumer reaches the bytes of the views the object lends, nothing else of that storage,
and a ref whose views or dtypes were altered maps nothing. In one process, no cluster
(the descriptor is opened through /proc as another process's would be)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import rdt_async as rdt
from rdt_async import _io
from rdt_async._local import pid_alive
from rdt_async.transports import _segments, shm
from rdt_async.transports._base import TensorSpec, TransferInfo

OBJ = "cd" * 12


@pytest.fixture
def lent():
    """A 4 MiB shared storage whose floats 1000..1015 are lent (0..15); the rest is the
    producer's own: -7.0 before the view, -9.0 after it."""
    w = torch.zeros(1 << 20)
    w[:1000], w[1000:1016], w[2000:2100] = -7.0, torch.arange(16.0), -9.0
    w.share_memory_()
    views = [w[1000:1016], w[1000:1016].view(4, 4).t()]
    transport = shm.ShmTransport()
    meta = transport.prepare(OBJ, views)
    assert meta.shared and all(sh is not None for sh in meta.shared), meta  # lent, not copied
    yield transport, meta, views
    transport.garbage_collect(OBJ, meta)


def fetch(transport, meta, specs, into=None):
    """What a consumer gets: at once where shm answers so, else from its receive (into= a
    storage this large: read on the I/O loop's pool)."""
    info = TransferInfo(OBJ, tuple(specs), meta, producer_pid=os.getpid())
    now = transport.receive_nowait(info, into)
    return now if now is not None else _io.start(transport.receive(info, into, None)).result(30)


def test_a_lent_view_reaches_its_own_bytes_and_no_other_of_the_storage(lent):
    transport, meta, views = lent
    got = fetch(transport, meta, [TensorSpec.of(v) for v in views])
    assert [g.tolist() for g in got] == [v.tolist() for v in views]
    assert got[0].untyped_storage().nbytes() == 64 and got[1].untyped_storage().nbytes() == 64
    whole = torch.empty(0).set_(got[0].untyped_storage())  # all a consumer can reach through it
    assert whole.tolist() == list(range(16)) and not whole.eq(-7.0).any() and not whole.eq(-9.0).any()
    into = [torch.zeros(16), torch.zeros(4, 4)]
    got = fetch(transport, meta, [TensorSpec.of(v) for v in views], into)
    assert got is into or [g.data_ptr() for g in got] == [b.data_ptr() for b in into]
    assert into[0].tolist() == list(range(16)) and torch.equal(into[1], views[1])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float64, torch.int32])
def test_a_ref_whose_dtype_was_altered_maps_nothing(lent, dtype):
    # Offsets and strides count the dtype's elements: uint8 at element 1000 is byte 1000
    # (the producer's -7.0s), float64 at 1000 is byte 8000 (its -9.0s). int32: the very bytes
    # of the view, read as another type: a wrong value all the same.
    transport, meta, views = lent
    specs = [TensorSpec.of(views[0].view(torch.uint8)[: 16 * dtype.itemsize].view(dtype)), TensorSpec.of(views[1])]
    for into in (None, [torch.zeros(16, dtype=dtype), torch.zeros(4, 4)]):
        with pytest.raises(rdt.ObjectFreedError, match="not the one its producer lent for it"):
            fetch(transport, meta, specs, into)


def test_a_ref_whose_storage_size_was_altered_maps_nothing(lent):
    transport, meta, views = lent
    grown = dataclasses.replace(meta.shared[0], nbytes=meta.shared[0].nbytes - 4096)
    altered = dataclasses.replace(meta, shared=(grown, meta.shared[1]))
    with pytest.raises(rdt.ObjectFreedError, match="not the one its producer lent for it"):
        fetch(transport, altered, [TensorSpec.of(v) for v in views])


def test_a_ref_whose_inode_is_a_list_is_refused_naming_the_field(lent):
    transport, meta, views = lent
    listed = dataclasses.replace(meta.shared[0], inode=list(meta.shared[0].inode))
    with pytest.raises(rdt.TransferError, match="inode or stride that is not a tuple"):
        fetch(transport, dataclasses.replace(meta, shared=(listed, meta.shared[1])), [TensorSpec.of(v) for v in views])


def test_a_producer_forked_child_does_not_keep_its_segments_after_it_ends(tmp_path):
    # The guardian sweeps a producer's files once its pipe is closed at every end: a child
    # forked by the producer (a DataLoader worker) inherited an end, so the segments stayed
    # until the child ended too.
    code = (
        "import os, sys, time, torch\n"
        "from rdt_async.transports.shm import ShmTransport\n"
        "meta = ShmTransport().prepare('ef' * 12, [torch.ones(1 << 18)])\n"
        "print(meta.segment, flush=True)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(child, flush=True)\n"
    )
    said = tmp_path / "out"
    with open(said, "w") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, check=True, timeout=60)
    segment, child = said.read_text().split()
    try:
        path = os.path.join(_segments.SHM_DIR, segment)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path), "the producer ended; its segment is still there while its forked child lives"
        assert pid_alive(int(child))  # (the child, still alive)
    finally:
        os.kill(int(child), signal.SIGKILL)
