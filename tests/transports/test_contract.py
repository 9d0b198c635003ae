"""The contract every transport keeps, run between two plain processes (no Ray).

Select transports with RDT_CONTRACT_TRANSPORTS (comma-separated) and the tensors'
device with RDT_CONTRACT_DEVICE (cpu or cuda): the GPU machine runs this file alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from probes import cancel_after, nixl_stalling

import rdt_async as rdt
from rdt_async._avoid import unusable
from rdt_async.transports import _kit, _registry
from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo

from .contract import Producer, fetch, make_value

# The harness talks to its producer process with blocking calls on the test's loop (making
# a 64 MiB value there takes longer than the stall guard allows), so the guard of
# conftest.py is off here; the loop-stall checks of this suite are its own.
pytestmark = pytest.mark.allow_stall

DEVICE = os.environ.get("RDT_CONTRACT_DEVICE", "cpu")
# Optional transports join the default list where their package is installed.
OPTIONAL = [t for t in ("nixl", "cuda_ipc", "ucxx") if _registry.transport_class(t).unavailable_reason() is None]
TRANSPORTS = [
    t
    for t in os.environ.get("RDT_CONTRACT_TRANSPORTS", ",".join(["shm", "object_store", "tcp", *OPTIONAL])).split(",")
    if DEVICE in _registry.transport_class(t).devices
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def producer(request):
    reason = _registry.transport_class(request.param).unavailable_reason()
    if reason:
        pytest.skip(reason)
    p = Producer(request.param, DEVICE)
    yield p
    p.close()


@contextlib.contextmanager
def own_producer(name: str):
    """A producer of a test's own (it may free everything, stop or kill it); skips if unavailable."""
    reason = _registry.transport_class(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    p = Producer(name, DEVICE)
    try:
        yield p
    finally:
        p.close()


@contextlib.contextmanager
def stopped(p: Producer):
    """The producer process stopped (SIGSTOP) for the block, and resumed after it."""
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)


# An object read from the I/O loop, not on the caller's thread (past nixl's INLINE_BYTES),
# whose stall bound is STALL_S (its bytes at STALL_BYTES_PER_S take less than 0.5 s).
LOOP_READ = (1 << 20,)  # 4 MiB


def expect(obj_no: int, sizes=(1000, 7, 0)) -> list[torch.Tensor]:
    return [t.cpu() for t in make_value(obj_no, "cpu", sizes)]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape)
        assert torch.equal(g.cpu(), w)


async def test_values_arrive_intact(producer):
    info = producer.make(1)
    got = await fetch(producer, info)
    assert_same(got, expect(1))
    assert [g.device.type for g in got] == [DEVICE] * len(got)  # where they were produced


async def test_into_receives_into_caller_buffers(producer):
    info = producer.make(2)
    buffers = [torch.empty(s.shape, dtype=s.dtype, device=DEVICE) for s in info.specs]
    ptrs = [b.data_ptr() for b in buffers]
    got = await fetch(producer, info, buffers)
    assert [g.data_ptr() for g in got] == ptrs
    assert_same(got, expect(2))


async def test_a_transport_that_reports_landed_tells_of_every_byte_once_each_range_final_when_told(producer, monkeypatch):
    """`Transport.reports_landed`: each range told of (from any thread) is in the caller's
    buffers with its final bytes when told, and the ranges cover every byte once."""
    cls = _registry.transport_class(producer.transport)
    if not cls.reports_landed:
        pytest.skip(f"{producer.transport} does not report landed ranges")
    if producer.transport == "tcp":
        from rdt_async.transports import tcp

        monkeypatch.setattr(tcp, "LANDED_STEP", 1 << 16)  # many ranges of a small object
    sizes = (700_000, 70_000, 7, 0)
    want = [t.reshape(-1).view(torch.uint8) for t in expect(14, sizes)]
    buffers = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in producer.make(14, sizes).specs]
    raw = [b.reshape(-1).view(torch.uint8) for b in buffers]
    told: list[tuple[int, int, int, bool]] = []

    def landed(i: int, off: int, n: int) -> None:
        told.append((i, off, n, torch.equal(raw[i][off : off + n].cpu(), want[i][off : off + n])))

    info = dataclasses.replace(producer.make(14, sizes), landed=landed)
    got = await fetch(producer, info, buffers)
    assert_same(got, expect(14, sizes))
    assert told and all(final for *_, final in told), [t for t in told if not t[3]][:5]
    for i, w in enumerate(want):
        spans = sorted((off, off + n) for j, off, n, _ in told if j == i)
        assert [a for a, _ in spans] == [0, *(b for _, b in spans[:-1])] if spans else w.numel() == 0, (i, spans[:5])
        assert (spans[-1][1] if spans else 0) == w.numel()
    assert max(n for _, _, n, _ in told) <= (1 << 16 if producer.transport == "tcp" else max(w.numel() for w in want))


async def test_fetches_into_registered_buffers_register_nothing_more(producer):
    # rdt.register_memory (Ray's register_nixl_memory), consumer side: buffers registered
    # once are reused by every fetch into them; closing gives the registration back.
    transport = _registry.transport(producer.transport)
    if not transport.registers_memory:
        pytest.skip(f"{producer.transport} registers no memory ahead of time")
    sizes = (1 << 18,)  # 1 MiB and the small ones: over the bounce chunk, so each fetch would register
    infos = [producer.make(40 + i, sizes) for i in range(3)]
    buffers = [torch.empty(s.shape, dtype=s.dtype, device=DEVICE) for s in infos[0].specs]
    await fetch(producer, infos[0])  # connected, and the agent made
    before = transport.memory_stats()
    reg = await rdt.register_memory(buffers, transport=producer.transport)
    held = transport.memory_stats()
    assert held["held_storages"] == before["held_storages"] + len(buffers)
    for i, info in enumerate(infos):
        got = await fetch(producer, info, buffers)
        assert [g.data_ptr() for g in got] == [b.data_ptr() for b in buffers]
        assert_same(got, expect(40 + i, sizes))
    assert transport.memory_stats()["registered_total"] == held["registered_total"]  # none per fetch
    reg.close()
    deadline = time.monotonic() + 5
    while transport.memory_stats()["storages"] > before["storages"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    after = transport.memory_stats()
    assert (after["storages"], after["bytes"], after["held_storages"]) == (
        before["storages"], before["bytes"], before["held_storages"]
    )


async def test_into_buffers_on_the_other_device(producer):
    # CPU -> CUDA and CUDA -> CPU in one read, for transports that say they can
    # (`cross_device_buffers`; what `fetch(device=...)` relies on). Needs a GPU.
    other = "cpu" if DEVICE == "cuda" else "cuda"
    transport = _registry.transport(producer.transport)
    if not transport.cross_device_buffers or other not in transport.devices:
        pytest.skip(f"{producer.transport} does not read across devices")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    info = producer.make(3)
    buffers = [torch.empty(s.shape, dtype=s.dtype, device=other) for s in info.specs]
    ptrs = [b.data_ptr() for b in buffers]
    got = await fetch(producer, info, buffers)
    assert [g.data_ptr() for g in got] == ptrs and all(g.device.type == other for g in got)
    assert_same(got, expect(3))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA stream order: RDT_CONTRACT_DEVICE=cuda")
async def test_queued_producer_kernels_finish_before_the_read(producer):
    # The producer's tensors are still being written by queued kernels when it returns.
    info = producer.call("make_late", 6, (1 << 20,))
    assert_same(await fetch(producer, info), expect(6, (1 << 20,)))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA stream order: RDT_CONTRACT_DEVICE=cuda")
async def test_queued_kernels_on_into_buffers_finish_before_the_write(producer):
    # The caller's stream still has a kernel queued that writes the buffers: the fetch
    # must land after it, not be overwritten by it.
    info = producer.make(7, (1 << 20,))
    buffers = [torch.empty(s.shape, dtype=s.dtype, device="cuda") for s in info.specs]
    torch.cuda._sleep(200_000_000)
    for b in buffers:
        b.fill_(3)
    got = await fetch(producer, info, buffers)
    torch.cuda.synchronize()
    assert_same(got, expect(7, (1 << 20,)))


async def test_many_concurrent_fetches(producer):
    infos = [producer.make(10 + i, (4096,)) for i in range(8)]
    results = await asyncio.gather(*(fetch(producer, info) for info in reversed(infos)))
    for i, got in enumerate(reversed(results)):
        assert_same(got, expect(10 + i, (4096,)))


async def test_cancel_mid_fetch_then_fetch_again(producer):
    info = producer.make(3, (16 << 20,))
    task = asyncio.ensure_future(fetch(producer, info))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_same(await fetch(producer, info), expect(3, (16 << 20,)))


@pytest.mark.parametrize("after", [0.0, 0.003, 0.01])
async def test_cancelled_fetch_into_buffers_is_not_written_after_it_returns(producer, after):
    info = producer.make(5, (16 << 20,))  # 64 MiB
    buffers = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in info.specs]
    await cancel_after(fetch(producer, info, buffers), after)
    then = [b.clone() for b in buffers]
    await asyncio.sleep(0.3)
    assert all(torch.equal(t, b) for t, b in zip(then, buffers)), "written after the cancel returned"
    assert_same(await fetch(producer, info, buffers), expect(5, (16 << 20,)))


@pytest.mark.parametrize("n", [1 << 10, 1 << 20])  # one message, and UCX's rendezvous
async def test_a_fetch_cancelled_past_the_drain_bound_never_writes_its_buffers_later(producer, n, monkeypatch):
    # The producer is stopped, so receives it was to answer stay pending past the
    # bound a cancelled fetch waits for them. Once the fetch has returned, the
    # producer resumes and answers: nothing of that answer may land in the buffers.
    for module in ("gloo", "ucxx"):
        monkeypatch.setattr(f"rdt_async.transports.{module}.DRAIN_S", 0.3, raising=False)
    p = producer
    assert_same(await fetch(p, p.make(8)), expect(8))  # connected, warm
    info = p.make(9, (n,))
    buffers = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in info.specs]
    with stopped(p):
        async with asyncio.timeout(20):
            await cancel_after(fetch(p, info, buffers), 0.2)
        then = [b.clone() for b in buffers]
    await asyncio.sleep(0.5)  # the producer's answer, if anything still waits for it
    assert all(torch.equal(t, b) for t, b in zip(then, buffers)), "written after the cancel returned"
    assert_same(await fetch(p, info, buffers), expect(9, (n,)))  # and the producer serves again


@pytest.mark.parametrize("n", [1 << 10, 1 << 20])
async def test_a_fetch_into_its_own_memory_from_a_stopped_producer_is_cancelled_at_once(producer, n):
    # No caller buffer to protect: the cancel returns now, not after the drain bound,
    # and the answer that comes later neither breaks the connection nor lands anywhere.
    p = producer
    assert_same(await fetch(p, p.make(8)), expect(8))  # connected, warm
    info = p.make(9, (n,))
    with stopped(p):
        t0 = time.monotonic()
        async with asyncio.timeout(20):
            await cancel_after(fetch(p, info), 0.2)
        took = time.monotonic() - t0
    assert took < 5, f"the cancel waited {took:.1f} s"  # a hang check: the drain bound is 30 s
    await asyncio.sleep(0.3)  # the late answer arrives
    assert_same(await fetch(p, info), expect(9, (n,)))
    assert_same(await fetch(p, p.make(10)), expect(10))


@pytest.mark.parametrize("elements", [2000, 500], ids=["more", "fewer"])
async def test_a_ref_whose_specs_claim_other_sizes_than_the_objects_is_refused(producer, elements):
    # A spec altered to claim more bytes than the tensor has left the rest of the receive
    # buffer as it was (over ucxx: a reused landing buffer's, an earlier fetch's bytes);
    # fewer returned a prefix (tcp). The sizes must be the object's.
    info = producer.make(5)
    assert info.specs[0].shape == (1000,)
    spec = TensorSpec((elements,), info.specs[0].dtype, info.specs[0].device, elements * 4)
    altered = dataclasses.replace(info, specs=(spec, *info.specs[1:]))
    with pytest.raises(rdt.RDTError) as raised:
        async with asyncio.timeout(30):
            await fetch(producer, altered)
    assert not isinstance(raised.value, rdt.PeerDiedError), raised.value
    assert_same(await fetch(producer, info), expect(5))  # the object itself, as it is


@pytest.mark.parametrize("sizes", [(1000, 7, 0), (1 << 16, 3)])  # small, and over 256 KiB
async def test_fetch_after_free_raises_object_freed(producer, sizes):
    info = producer.make(4, sizes)
    producer.call("free", info.obj_id)
    with pytest.raises(rdt.ObjectFreedError):
        await fetch(producer, info)


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_first_contact_with_an_object_freed_meanwhile_raises_object_freed(name):
    # The producer holds nothing by the time this consumer first reaches it.
    with own_producer(name) as p:
        info = p.make(4)
        p.call("free", info.obj_id)
        await asyncio.sleep(0.5)  # past any linger: nothing registered is left
        with pytest.raises(rdt.ObjectFreedError):
            async with asyncio.timeout(20):
                await fetch(p, info)


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_dead_producer_fails_in_bounded_time(name):
    with own_producer(name) as p:
        info = p.make(5)
        p.proc.kill()
        p.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(rdt.RDTError):
            async with asyncio.timeout(30):
                await fetch(p, info)
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("n", [1024, 64 << 20])
@pytest.mark.parametrize("name", TRANSPORTS)
async def test_producer_stopped_then_killed_mid_fetch_fails_in_bounded_time(name, n):
    # The producer is stopped before the fetch starts (it never answers) and killed
    # during it: the fetch ends, with the whole value (one-sided reads need no answer)
    # or an RDTError, and never waits for messages a dead producer will not send.
    with own_producer(name) as p:
        assert_same(await fetch(p, p.make(8)), expect(8))  # connected, warm
        info = p.make(9, (n,))
        os.kill(p.proc.pid, signal.SIGSTOP)
        task = asyncio.ensure_future(fetch(p, info))
        await asyncio.sleep(0.2)
        p.proc.kill()
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(30):
                got = await task
        except rdt.RDTError:
            pass
        else:
            assert_same(got, expect(9, (n,)))
        assert time.monotonic() - t0 < 20


@pytest.mark.skipif("shm" not in TRANSPORTS, reason="shm not selected")
async def test_shm_segment_left_by_a_dead_producer_is_refused():
    # A killed producer's segment lives until its guardian unlinks it: in that window a
    # fetch must fail, not serve a dead object.
    from rdt_async.transports import _segments, shm

    dead = subprocess.Popen(["true"])
    dead.wait()
    key = _segments.new_key()
    name = _segments.name_for("obj-dead", key, 64, [(0, 64)], dead.pid)
    path = os.path.join(shm.SHM_DIR, name)
    want = torch.arange(16, dtype=torch.float32)
    with open(path, "wb") as f:
        f.write(want.numpy().tobytes())
    try:
        meta = shm.ShmMeta(name, 64, (0,), key=key)
        info = TransferInfo("obj-dead", (TensorSpec.of(want),), meta, producer_pid=dead.pid)
        transport = shm.ShmTransport()
        with pytest.raises(rdt.PeerDiedError, match="producer of obj-dead died"):
            transport.receive_nowait(info, None)
        with pytest.raises(rdt.PeerDiedError, match="producer of obj-dead died"):
            await transport.receive(info, [torch.empty(16)], channel=None)
    finally:
        os.unlink(path)


@pytest.mark.skipif("shm" not in TRANSPORTS, reason="shm not selected")
def test_shm_producer_exiting_leaves_no_segment_and_no_open_pipe():
    # The guardian's pipe is closed at exit (no ResourceWarning), and the guardian then
    # unlinks what the process left.
    from rdt_async.transports import shm

    code = (
        "import os, torch\n"
        "from rdt_async.transports import _registry\n"
        "m = _registry.transport('shm').prepare('kept', [torch.ones(1000)])\n"
        "print(os.getpid(), m.segment)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", code], capture_output=True, text=True, timeout=120
    )
    pid, segment = out.stdout.split()
    assert segment.startswith(f"{shm.PREFIX}{pid}-") and "ResourceWarning" not in out.stderr, out.stderr
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.join(shm.SHM_DIR, segment)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, segment))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_posts_nothing_to_a_producer_known_dead():
    # A READ posted to a dead agent leaves a UCX request behind inside NIXL: a producer
    # on this host that is gone fails the fetch before anything is posted.
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8)), expect(8))  # connected
        info = p.make(9)
        p.proc.kill()
        p.proc.join(10)
        nx = _registry.transport("nixl").agent().nixl
        posted = []
        real = nx.initialize_xfer
        nx.initialize_xfer = lambda *a: posted.append(a) or real(*a)
        try:
            with pytest.raises(rdt.PeerDiedError, match=f"producer \\(pid {p.proc.pid} on .*\\) died"):
                await fetch(p, info)
        finally:
            del nx.initialize_xfer
        assert posted == []



@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
@pytest.mark.parametrize("freed", [True, False])
async def test_nixl_read_failing_as_a_disconnect_from_a_live_producer(freed):
    # A READ of memory the producer unmapped (a free() racing the read past the linger)
    # fails UCX's endpoint: NIXL then reports every READ over it as a disconnect until
    # the agent is removed, reads of objects still held included. Emulated here, as
    # the race itself is timing-bound.
    from nixl._bindings import nixlRemoteDisconnectError

    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8)), expect(8))  # connected
        info = p.make(9)
        if freed:
            p.call("free", info.obj_id)
        nx = _registry.transport("nixl").agent().nixl
        broken = [True]
        real_transfer, real_remove = nx.transfer, nx.remove_remote_agent

        def transfer(handle):
            if broken[0]:
                raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
            return real_transfer(handle)

        def remove_remote_agent(name):
            broken[0] = False
            return real_remove(name)

        nx.transfer, nx.remove_remote_agent = transfer, remove_remote_agent
        try:
            if freed:
                with pytest.raises(rdt.ObjectFreedError):
                    await fetch(p, info)
            else:  # read again over a fresh connection
                assert_same(await fetch(p, info), expect(9))
        finally:
            del nx.transfer, nx.remove_remote_agent
        assert_same(await fetch(p, p.make(10)), expect(10))  # connected anew


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_read_that_stalls_is_cut_off_and_read_again_over_a_fresh_connection(monkeypatch):
    from rdt_async.transports.nixl import _xfer

    monkeypatch.setattr(_xfer, "STALL_S", 0.5)
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8, LOOP_READ)), expect(8, LOOP_READ))  # connected
        info = p.make(9, LOOP_READ)
        nx = _registry.transport("nixl").agent().nixl
        began = time.monotonic()
        with nixl_stalling(nx, until_removed=info.meta.agent) as (_, removed):
            async with asyncio.timeout(30):  # (without a bound: for good)
                assert_same(await fetch(p, info), expect(9, LOOP_READ))
        took = time.monotonic() - began
        assert removed.count(info.meta.agent) == 1 and 0.5 <= took < 10, (removed, took)  # cut off once, at the bound
        assert_same(await fetch(p, p.make(10, LOOP_READ)), expect(10, LOOP_READ))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_read_whose_connection_another_reads_stall_cut_off_reads_again(monkeypatch):
    # Two reads share the connection to their producer; the first stalls and has it cut
    # off, which ends the second's READ in an error (emulated: NIXL's state for a READ
    # whose remote agent was removed under it): the second reads again, as the first does.
    from rdt_async.transports.nixl import _xfer

    monkeypatch.setattr(_xfer, "STALL_S", 1.0)
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8, LOOP_READ)), expect(8, LOOP_READ))  # connected
        first, second = p.make(9, LOOP_READ), p.make(10, LOOP_READ)
        nx = _registry.transport("nixl").agent().nixl
        with nixl_stalling(nx, until_removed=first.meta.agent, others_fail=True) as (posted, removed):
            async with asyncio.timeout(30):
                one = asyncio.ensure_future(fetch(p, first))
                while not posted:
                    await asyncio.sleep(0.01)
                two = await fetch(p, second)  # waits on the connection the first stalls on
                assert_same(await one, expect(9, LOOP_READ))
            assert_same(two, expect(10, LOOP_READ))
        assert len(posted) >= 2 and removed.count(first.meta.agent) == 1, (posted, removed)


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_read_that_stalls_again_over_a_fresh_connection_fails_naming_the_bound(monkeypatch):
    from rdt_async.transports.nixl import _transport, _xfer

    monkeypatch.setattr(_xfer, "STALL_S", 0.5)
    monkeypatch.setattr(_xfer, "ABORT_GRACE_S", 0.5)
    monkeypatch.setattr(_transport, "RECHECK_S", 1.0)  # (the fresh connection's read stalls too)
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8, LOOP_READ)), expect(8, LOOP_READ))  # connected
        info = p.make(9, LOOP_READ)
        nx = _registry.transport("nixl").agent().nixl
        with nixl_stalling(nx, until_removed=None) as (_, removed):
            with pytest.raises(_xfer.ReadStalled, match=r"stalled: still in progress after \d+ s .*RDT_NIXL_STALL_S") as raised:
                async with asyncio.timeout(30):
                    await fetch(p, info)
        assert removed.count(info.meta.agent) == 2, removed  # the READ's connection, and the fresh one's
        # A path with no answer from this producer: `auto` takes another (test_nixl.py shows it).
        assert "stall: none ended over a fresh connection either" in (unusable(raised.value) or ""), raised.value.__cause__
        assert_same(await fetch(p, p.make(10, LOOP_READ)), expect(10, LOOP_READ))  # and reads anew


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_read_into_caller_buffers_that_will_not_end_fails_at_once_naming_the_fix(monkeypatch, caplog):
    # A READ NIXL leaves in progress after its connection is cut off may land later; where
    # it lands in the caller's into= buffers, no READ may go into them again (the stall's
    # second try did: it returned them, and the first READ could write them after) nor a
    # fallback: the fetch fails at once, telling the caller to give them up.
    from rdt_async.transports.nixl import _plan, _xfer

    monkeypatch.setattr(_xfer, "STALL_S", 0.5)
    monkeypatch.setattr(_xfer, "ABORT_GRACE_S", 0.5)
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8, LOOP_READ)), expect(8, LOOP_READ))  # connected
        info = p.make(9, LOOP_READ)
        buffers = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in info.specs]
        kept = len(_plan._kept_for_nixl)
        nx = _registry.transport("nixl").agent().nixl
        with nixl_stalling(nx, until_removed=None) as (posted, removed):
            with pytest.raises(rdt.TransferAbortedError, match=r"into= buffers could not be ended .*Give them up") as raised:
                async with asyncio.timeout(30):
                    await fetch(p, info, buffers)
        assert type(raised.value).__name__ == "StillWriting" and unusable(raised.value) is None, raised.value
        assert len(posted) == 1 and removed.count(info.meta.agent) == 1, (posted, removed)  # never read again
        assert len(_plan._kept_for_nixl) == kept + 1 and "into= buffers, which NIXL may still write" in caplog.text
        plain = p.make(10, LOOP_READ)  # a fetch into memory of its own is read as before
        assert_same(await fetch(p, plain), expect(10, LOOP_READ))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_read_broken_on_an_old_connection_leaves_the_new_one_alone():
    # Reads that broke on one connection each drop it; the first may have connected
    # anew already, and a later one must not drop that fresh connection.
    with own_producer("nixl") as p:
        info = p.make(8)
        assert_same(await fetch(p, info), expect(8))
        t = _registry.transport("nixl")
        agent, peers, producer = t.agent(), t._current().peers, info.meta.agent
        old = peers.epoch(producer)
        await peers.forget(producer, old)  # the first read that broke
        assert peers.remote(producer) is None
        assert_same(await fetch(p, p.make(9)), expect(9))  # connected anew
        new, removed = peers.epoch(producer), []
        real_remove = agent.nixl.remove_remote_agent
        agent.nixl.remove_remote_agent = lambda name: removed.append(name) or real_remove(name)
        try:
            await peers.forget(producer, old)  # a later read that broke on the old one
        finally:
            del agent.nixl.remove_remote_agent
        assert removed == [] and peers.epoch(producer) == new and peers.remote(producer) is not None
        assert_same(await fetch(p, p.make(10)), expect(10))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_concurrent_fetches_cancelled_again_and_again_leave_no_registration():
    # A fetch cancelled while its destination was being registered in the pool (the
    # agent busy with another fetch's copy) left that registration, and its buffer, for good.
    transport = _registry.transport("nixl")
    with own_producer("nixl") as p:
        infos = [p.make(20 + i, (8 << 20,)) for i in range(8)]  # 32 MiB each
        await asyncio.to_thread(transport.warm_up)
        before = transport.registrations

        async def fetch_one(info):
            return await FetchRequest.start(transport, info, channel=p.channel(info.obj_id)).wait()

        for _ in range(40):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.01):
                    await asyncio.gather(*(fetch_one(info) for info in infos))
        # A cancelled READ that NIXL does not end at once is let go after its grace
        # (ABORT_GRACE_S, 5 s), and its registration with it: on a loaded machine, some do.
        from rdt_async.transports.nixl import _xfer

        deadline = time.monotonic() + _xfer.ABORT_GRACE_S + 15
        while transport.registrations > before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert transport.registrations == before
        assert_same(await fetch(p, infos[0]), expect(20, (8 << 20,)))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
def test_a_nixl_read_handle_that_is_kept_is_never_released_by_the_garbage_collector():
    # NIXL's handle releases itself once garbage, from whatever thread collects it and
    # without the agent's lock: a READ still in progress (stuck) or one NIXL refused to
    # release must not be let go that way (a collection inside `transfer` crashed a consumer).
    import gc

    from nixl._api import nixl_xfer_handle

    from rdt_async.transports.nixl import _xfer

    class Agent:  # what a handle calls into: NIXL's C++ agent
        released: list[int] = []

        def releaseXferReq(self, h):
            self.released.append(h)

    class Refusing:  # nixl_agent.release_xfer_handle, for a READ NIXL cannot let go of
        def release_xfer_handle(self, handle):
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    agent, before = Agent(), len(_xfer._kept_handles)
    _xfer.keep(nixl_xfer_handle(agent, 0x51))
    with pytest.raises(RuntimeError, match="REPOST_ACTIVE"):
        _xfer.release(Refusing(), nixl_xfer_handle(agent, 0x52))
    nixl_xfer_handle(agent, 0x53)  # one nobody keeps: released as it goes (what the others must not be)
    gc.collect()
    assert agent.released == [0x53]
    assert [h._handle for h in _xfer._kept_handles[before:]] == [0x51, 0x52]
    del _xfer._kept_handles[before:]  # (armless now: their finalizers release nothing)
    gc.collect()
    assert agent.released == [0x53]


async def test_an_object_store_reply_owns_its_bytes_before_the_store_lets_the_object_go():
    # Ray serializes a method's reply after it returned, when the store no longer holds
    # the object: a reply of views of the producer's tensors was read after
    # `wait_tensor_freed` may have let the producer write them (the newer value, or a mix).
    import numpy as np

    from rdt_async.transports import object_store

    plain = torch.arange(1 << 16, dtype=torch.float32)
    strided = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    reply = await object_store.ObjectStoreTransport().send_multiple_tensors("obj", [plain, strided], None, None)
    assert not any(np.shares_memory(a, t.numpy()) for a, t in zip(reply, [plain, strided]))
    plain.add_(1)  # the producer writes its tensor again
    assert torch.equal(torch.frombuffer(reply[0], dtype=torch.float32), torch.arange(1 << 16, dtype=torch.float32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_ipc_refuses_clearly_without_cuda():
    reason = _registry.transport_class("cuda_ipc").unavailable_reason()
    assert reason == "no CUDA device in this process (torch.cuda.is_available() is False)"
    with pytest.raises(rdt.TransportUnavailableError, match="transport 'cuda_ipc' is unavailable: no CUDA device"):
        _registry.transport("cuda_ipc")


def test_cuda_ipc_refuses_a_producer_on_another_node():
    # The node check comes before anything touches CUDA: it holds on any machine.
    from rdt_async.transports import cuda_ipc

    meta = cuda_ipc.CudaIpcMeta("elsewhere/boot", 1, (None,), "rdt-1-ipc-x", 0, 1)
    info = TransferInfo("obj-far", (TensorSpec((0,), torch.float32, "cuda:0", 0),), meta)
    with pytest.raises(rdt.TransportUnavailableError, match=r"on another node \(elsewhere\).*use tensor_transport='nixl'"):
        cuda_ipc.CudaIpcTransport()._check_live(info)


def test_cuda_ipc_refuses_a_ref_whose_exports_its_producer_did_not_make_for_the_object():
    """A ref altered to read elsewhere in the producer's allocation (its offset moved inside
    the caching allocator's segment: other tensors' bytes), or pointing at another object's
    handle under its own token, is refused before anything is mapped. The liveness table
    is plain shared memory: this holds on any machine."""
    from rdt_async.transports import cuda_ipc

    producer, consumer = cuda_ipc.CudaIpcTransport(), cuda_ipc.CudaIpcTransport()
    mine = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 512, 1024), None)
    other = (cuda_ipc.IpcTensor("GPU-0", b"b" * 64, 0, 1024), None)
    specs = (TensorSpec((256,), torch.float32, "cuda:0", 1024), TensorSpec((0,), torch.float32, "cuda:0", 0))
    table, slot, token = producer._take_slot(_kit.digest("obj-mine", mine))
    try:
        def info(obj_id, tensors, token=token):
            meta = cuda_ipc.CudaIpcMeta(cuda_ipc._host(), os.getpid(), tensors, table, slot, token)
            return TransferInfo(obj_id, specs, meta, producer_pid=os.getpid())

        consumer._check_live(info("obj-mine", mine))  # as made: passes
        moved = (dataclasses.replace(mine[0], offset=0), None)
        for obj_id, tensors in [("obj-mine", moved), ("obj-mine", other), ("obj-other", mine)]:
            with pytest.raises(rdt.TransferError, match=r"its ref's exports are not the ones its producer made for it \(the ref was altered\); nothing was mapped"):
                consumer._check_live(info(obj_id, tensors))
        with pytest.raises(rdt.ObjectFreedError, match="no longer holds it"):
            consumer._check_live(info("obj-mine", mine, token=token ^ 1))
    finally:
        for t in (*producer._tables, *consumer._mapped.values()):
            t.close()
        os.unlink(os.path.join("/dev/shm", table))


async def test_cuda_ipc_a_fetch_cancelled_while_its_segment_is_first_mapped_leaves_the_mapping_whole(monkeypatch):
    """The first fetch of a segment maps it (cuIpcOpenMemHandle, in a thread) for every
    fetch of it; cancelling that fetch must neither cancel the shared mapping (later
    fetches would fail on it) nor leave the handle open for good. The driver calls are
    stand-ins here: this checks the mapping's bookkeeping, on any machine."""
    import threading

    from rdt_async.transports import _cudadrv, cuda_ipc

    opening, go, closed = threading.Event(), threading.Event(), []

    def open_handle(handle: bytes, index: int) -> int:
        opening.set()
        go.wait(10)
        return 0x10000

    monkeypatch.setattr(_cudadrv, "open_handle", open_handle)
    monkeypatch.setattr(_cudadrv, "close_handle", lambda ptr, index: closed.append(ptr))
    monkeypatch.setattr(_cudadrv, "bytes_from", lambda ptr, index: 1 << 20)
    monkeypatch.setattr(cuda_ipc, "_map_index", lambda m: 0)
    monkeypatch.setattr(cuda_ipc, "_wrap", lambda address, nbytes, index: (address, nbytes))
    monkeypatch.setattr(cuda_ipc, "MAP_IDLE_S", 0.1)
    maps, m = cuda_ipc._Mappings(), cuda_ipc.IpcTensor("GPU-x", b"h" * 64, 16, 100)

    async def fetch():
        with maps.using([m]) as use:
            await use.mapped()
            return use.sources

    first = asyncio.ensure_future(fetch())
    assert await asyncio.to_thread(opening.wait, 10)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    go.set()
    assert await asyncio.wait_for(fetch(), 10) == [(0x10000 + 16, 100)]  # the same mapping, whole
    for _ in range(100):
        if closed:
            break
        await asyncio.sleep(0.05)
    assert closed == [0x10000] and not maps._maps  # closed once, when idle


class _Copy:
    """A stand-in for a queued copy's CUDA event: landed once `at` (perf_counter) has passed."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at


async def test_cuda_ipc_waits_for_a_copy_on_the_loop_asleep_first_and_hands_a_late_one_to_the_pool():
    """cuda_ipc's wait for its copy: asleep on the loop until shortly before the expected
    end, then polled between the loop's other work, seen within ~1 ms of landing; a copy
    running past CLOSE_S is waited for in the pool (the loop's thread is not kept busy). The
    events are stand-ins: this checks the wait's schedule, on any machine."""
    from rdt_async.transports import cuda_ipc

    ticks: list[tuple[float, float]] = []  # (when, the loop thread's CPU time then)

    async def ticker():  # the loop stays free: its other task runs through the wait
        while True:
            ticks.append((time.perf_counter(), time.thread_time()))
            await asyncio.sleep(0.001)

    beside = asyncio.ensure_future(ticker())
    try:
        for late_s in (0.0, 0.004):  # on time; running well past its expected end
            t0 = time.perf_counter()
            lands, expected = t0 + 0.02, t0 + 0.02 - late_s
            ticks.clear()
            await cuda_ipc._wait_landed([_Copy(lands)], expected)
            seen = time.perf_counter() - lands
            assert 0 <= seen < 0.005, f"landed {seen * 1e3:.2f} ms before it was seen (late by {late_s})"
            gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(ticks)]
            # A long gap is the loop held only where its thread ran through it: one spent
            # waiting for a core (another test's cluster beside this one, 2 cores) is not
            # the wait's doing (CI saw a 13 ms gap with the thread's CPU idle).
            held = [(wall, cpu) for wall, cpu in gaps if wall >= 0.01 and cpu >= 0.005]
            assert len(ticks) >= 5 and not held, f"the loop was held: (gap, its CPU) {held} of {gaps}"
    finally:
        beside.cancel()


async def best_gb_s(p: Producer, obj_no: int, sizes: tuple[int, ...], device: str) -> float:
    """Fetch object `obj_no` of `p` into buffers on `device` 4 times (zeroed before each),
    checking where and what landed each time; return the best pass in GB/s."""
    info = p.make(obj_no, sizes)
    buffers = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in info.specs]
    best = float("inf")
    for _ in range(4):
        for b in buffers:
            b.zero_()
        t0 = time.perf_counter()
        got = await fetch(p, info, buffers)
        best = min(best, time.perf_counter() - t0)
        assert [g.data_ptr() for g in got] == [b.data_ptr() for b in buffers]
        assert_same(got, expect(obj_no, sizes))
    return sum(b.numel() * b.element_size() for b in buffers) / best / 1e9


GPU_READ_FLOOR_GB_S = 20.0  # a device path moves 100s of GB/s; UCX's TCP path through the host moved 0.43


@pytest.mark.skipif(DEVICE != "cuda", reason="a floor on reads of GPU memory: the GPU machine's run")
async def test_nixl_reads_gpu_memory_over_a_device_path():
    # One node, one GPU, two processes: a NIXL READ of GPU memory must take a device path
    # (UCX's cuda_ipc), not TCP through host memory. UCX turns cuda_ipc's GETs off on GPUs
    # without NVLink; the transport turns them on (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on).
    if os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on") != "on":
        pytest.skip("the environment sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    with own_producer("nixl") as p:
        gb_s = await best_gb_s(p, 60, (64 << 20,), "cuda")  # 256 MiB of float32, and the small ones
    assert gb_s >= GPU_READ_FLOOR_GB_S, (
        f"nixl read GPU memory at {gb_s:.2f} GB/s (best of 4, 256 MiB): UCX took a host path, not cuda_ipc"
    )


CROSS_FLOOR_GB_S = 2.0  # through a stage: GB/s; over TCP through host staging it moved 0.4-0.8


@pytest.mark.skipif(DEVICE != "cuda", reason="reads across devices: the GPU machine's run")
@pytest.mark.parametrize("src, dst", [("cpu", "cuda"), ("cuda", "cpu")])
async def test_nixl_reads_across_devices_on_one_node_through_a_stage(src, dst):
    # UCX has no path between host and device memory of two processes (CMA is host to
    # host, CUDA IPC device to device): the read lands in a stage of the source's kind
    # and is copied by the device; the values arrive whole, at GB/s.
    if _registry.transport_class("nixl").unavailable_reason():
        pytest.skip("nixl is not installed")
    p = Producer("nixl", src)
    try:
        gb_s = await best_gb_s(p, 61, (16 << 20, 1000), dst)  # 64 MiB of float32, and a small one (read directly)
    finally:
        p.close()
    assert gb_s >= CROSS_FLOOR_GB_S, f"nixl read {src} -> {dst} at {gb_s:.2f} GB/s (best of 4, 64 MiB): not through a stage"


def test_nixl_sets_ucx_cuda_settings_only_with_a_gpu_and_only_while_its_agent_is_made(monkeypatch):
    from rdt_async.transports.nixl import _agent

    key = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.delenv(key, raising=False)
    with _agent.ucx_settings():  # no GPU here (or stand-in): UCX would warn of a CUDA variable it lacks
        if not torch.cuda.is_available():
            assert key not in os.environ
    assert key not in os.environ  # not left to the process's children
    monkeypatch.setattr(_agent, "_cuda_context", lambda: True)
    with _agent.ucx_settings():
        assert os.environ[key] == "on"
    assert key not in os.environ
    monkeypatch.setenv(key, "auto")  # the user's choice stands
    with _agent.ucx_settings():
        assert os.environ[key] == "auto"
    assert os.environ[key] == "auto"


def test_nixl_tensors_fetched_into_one_block_carry_no_earlier_receives_bytes():
    """Without into=, a fetch's CPU tensors are views of one block (one registration): each
    view's storage is the block, which holds this fetch's bytes and zeros only (a reused
    block held an earlier receive's bytes in its tail and in the gaps that align tensors)."""
    from rdt_async import _alloc, _io
    from rdt_async.transports.nixl import _plan

    mib = 1 << 20
    spec = TensorSpec((mib + 3,), torch.uint8, "cpu", mib + 3)  # 61 bytes short of 64-byte alignment
    earlier = _alloc.empty((4 * mib,), torch.uint8)  # the class the block takes: reused next
    earlier.fill_(0x53)
    del earlier
    _io.settle()
    views = _plan._views_of_blocks([spec, spec])
    for v in views:
        v.fill_(0x41)
    storage = views[0].untyped_storage()
    assert storage.data_ptr() == views[1].untyped_storage().data_ptr() and storage.nbytes() == 2 * (mib + 64)
    block = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert int((block == 0x53).sum()) == 0 and int((block == 0).sum()) == 2 * 61


def test_nixl_stages_only_reads_across_devices_on_one_node_from_a_mebibyte(monkeypatch):
    # Where a READ lands first (`_plan._stage_device`); the GPU run checks the values.
    from types import SimpleNamespace

    from rdt_async.transports.nixl import _plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def dst(device: str, nbytes: int):
        return SimpleNamespace(device=torch.device(device), numel=lambda: nbytes)

    big, small = 1 << 20, (1 << 20) - 1
    assert _plan._stage_device(dst("cuda:0", big), (0, big, 0, "DRAM"), True) == torch.device("cpu")
    assert _plan._stage_device(dst("cpu", big), (0, big, 1, "VRAM"), True) == torch.device("cuda", 1)
    assert _plan._stage_device(dst("cuda:0", small), (0, small, 0, "DRAM"), True) is None  # read directly
    assert _plan._stage_device(dst("cuda:0", big), (0, big, 0, "DRAM"), False) is None  # another node: UCX's path
    assert _plan._stage_device(dst("cuda:0", big), (0, big, 0, "VRAM"), True) is None  # same kind: CUDA IPC
    assert _plan._stage_device(dst("cpu", big), (0, big, 0, "DRAM"), True) is None  # same kind: CMA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _plan._stage_device(dst("cpu", big), (0, big, 0, "VRAM"), True) is None  # no GPU here to stage on



@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_region_that_comes_again_with_other_metadata_is_read_over_a_fresh_connection():
    # NIXL 1.5.1 refuses a region it holds that comes again with other backend metadata
    # (the producer registered that memory anew: over RDMA, another key; here one byte of
    # its blob changed), then forgets the producer but for its UCX connection, which it
    # never makes again: every later read from that live producer failed.
    with own_producer("nixl") as p:
        for no, sizes in ((8, (1000,)), (9, LOOP_READ)):  # read on the caller's thread, then from the I/O loop
            info = p.make(no, sizes)
            assert_same(await fetch(p, info), expect(no, sizes))  # its region loaded
            blob = info.meta.regs[0]
            resent = dataclasses.replace(info.meta, regs=(blob[:-3] + bytes([blob[-3] ^ 0xFF]) + blob[-2:],))
            assert_same(await fetch(p, dataclasses.replace(info, meta=resent)), expect(no, sizes))
            assert_same(await fetch(p, info), expect(no, sizes))  # each time over a fresh connection


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_connection_made_anew_waits_for_the_other_reads_on_the_old_one(monkeypatch):
    # A region that comes again with other metadata has the connection made anew: that
    # cut off every other read from the producer in progress on it (each read again).
    from rdt_async import _io
    from rdt_async.transports.nixl import _peers

    monkeypatch.setattr(_peers, "QUIET_S", 1.5)
    with own_producer("nixl") as p:
        info = p.make(9)
        assert_same(await fetch(p, info), expect(9))  # its region loaded
        peers, producer = _registry.transport("nixl")._current().peers, info.meta.agent
        blob = info.meta.regs[0]
        resent = dataclasses.replace(info, meta=dataclasses.replace(info.meta, regs=(blob[:-3] + bytes([blob[-3] ^ 0xFF]) + blob[-2:],)))
        for released, anew in ((True, resent), (False, info)):  # (each comes again with other metadata)
            epoch = peers.epoch(producer)
            _io.call_soon(peers.hold, producer)  # another read from it, in progress
            again = asyncio.ensure_future(fetch(p, anew))
            await asyncio.sleep(0.3)
            assert not again.done() and peers.epoch(producer) == epoch  # it waits, the connection stays
            if released:
                _io.call_soon(peers.release, producer)  # that read ended: the connection goes
            else:  # that read goes on: the connection goes after QUIET_S
                assert_same(await fetch(p, p.make(10)), expect(10))  # (a read with no quarrel goes on meanwhile)
                assert not again.done()
            async with asyncio.timeout(10):
                assert_same(await again, expect(9))
            assert peers.epoch(producer) != epoch
        _io.call_soon(peers.release, producer)


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_a_ref_whose_own_blobs_disagree_on_a_region_is_refused_and_leaves_the_connection():
    # A ref carrying one region in two blobs, one altered, passed the check: each fetch of
    # it then dropped the live producer's connection (cutting off the reads on it),
    # connected anew, met its own disagreement and failed as "registered a region anew".
    with own_producer("nixl") as p:
        info = p.make(8)
        assert_same(await fetch(p, info), expect(8))
        peers = _registry.transport("nixl")._current().peers
        epoch = peers.epoch(info.meta.agent)
        blob = info.meta.regs[0]
        altered = blob[:-3] + bytes([blob[-3] ^ 0xFF]) + blob[-2:]  # a byte of its last region's remote key
        crafted = dataclasses.replace(info, meta=dataclasses.replace(info.meta, regs=(blob, altered)))
        why = (
            rf"nixl fetch of {info.obj_id}: the ref's nixl metadata is not what its producer made \(region metadata 1 "
            r"declares DRAM region 0x[0-9a-f]+\+[0-9]+ of device 0 with other backend metadata than region metadata 0 "
            r"does\); nothing was read"
        )
        for _ in range(3):
            with pytest.raises(rdt.TransferError, match=why) as raised:
                await fetch(p, crafted)
            assert type(raised.value) is rdt.TransferError, raised.value
        assert peers.epoch(info.meta.agent) == epoch  # the connection stays
        assert_same(await fetch(p, info), expect(8))


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_objects_past_the_first_liveness_table_are_read_over_one_connection():
    # Past 1024 objects held, each object's metadata declares the second liveness table
    # too, in a blob of its own: a region held with another blob counted as registered
    # anew, and every fetch of another object dropped the connection and made it again.
    with own_producer("nixl") as p:
        infos = [p.make(no, (4,)) for no in range(1027)]  # (~1 s)
        assert_same(await fetch(p, infos[0]), expect(0, (4,)))
        peers = _registry.transport("nixl")._current().peers
        epoch = peers.epoch(infos[0].meta.agent)
        for no in (1024, 1025, 1026, 1024):
            assert_same(await fetch(p, infos[no]), expect(no, (4,)))
        assert peers.epoch(infos[0].meta.agent) == epoch


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_regions_held_of_a_producer_registering_new_memory_are_bounded(monkeypatch):
    # The regions NIXL holds of a producer were never let go: one registering new memory
    # every step grew them (here and in NIXL) for the connection's life. Past
    # REGIONS_MAX, a read that brings more connects anew.
    from rdt_async.transports.nixl import _peers

    monkeypatch.setattr(_peers, "REGIONS_MAX", 8)
    with own_producer("nixl") as p:
        held, epochs = [], set()
        for no, sizes in enumerate([(1000, 7, 0)] * 8 + [(*LOOP_READ, 7)] * 4):  # on the caller's thread, then the loop
            info = p.make(no, sizes)
            assert_same(await fetch(p, info), expect(no, sizes))
            peers = _registry.transport("nixl")._current().peers
            held.append(len(peers._regions[info.meta.agent]))
            epochs.add(peers.epoch(info.meta.agent))
        assert max(held) < 8 + 5 and len(epochs) >= 3, (held, epochs)  # (each object: 5 storages)


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
def test_nixl_metadata_parsed_from_refs_is_remembered_up_to_a_bound_in_bytes():
    # A ref's nixl blobs may be of any size: the check remembered its last 4096 parses,
    # and 1024 indexes of regions, each holding its blobs (1 MiB each here: GiBs).
    import gc
    import tracemalloc

    from rdt_async.transports.nixl import _check
    from rdt_async.transports.nixl._meta import NixlMeta

    def field(tag: bytes, data: bytes) -> bytes:
        return tag + struct.pack("<Q", len(data)) + data + b"|"

    host, pid, slot = "h", os.getpid(), 1 << 20
    agent = f"rdt-{host}-{pid}-0badcafe".encode()
    region = field(b"", struct.pack("<QQQ", slot, 64, 0))
    regs = b"nixlSerDes|" + field(b"Agent", agent) + field(b"Conns", struct.pack("<Q", 0)) + field(b"", b"MemSection") + (
        field(b"nixlSecElms", struct.pack("<Q", 1)) + field(b"bknd", b"UCX") + field(b"nixlDList", b"nixlSDList")
        + field(b"t", struct.pack("<I", 0)) + field(b"n", struct.pack("<Q", 1)) + region
    )
    check = _check.check  # (its lru_caches' first use allocates nothing later freed)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(48):
            conn = b"nixlSerDes|" + field(b"Agent", agent) + field(b"Conns", struct.pack("<Q", 1)) + (
                field(b"t", b"UCX") + field(b"c", i.to_bytes(8, "little") * (1 << 17)) + field(b"", b"MemSection")
                + field(b"nixlSecElms", struct.pack("<Q", 0))
            )
            meta = NixlMeta(agent.decode(), conn, (regs,), (), slot, 1, pid, host)
            check(TransferInfo(f"obj{i}", (), meta), pid)  # (a valid ref: no tensor)
            del conn, meta
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < _check.PARSED_BYTES + (4 << 20), f"{held >> 20} MiB held after 48 MiB of refs"  # (and some)


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
def test_nixl_regions_parsed_from_refs_count_toward_the_bound(monkeypatch):
    # The bound counted a blob's bytes, not the regions parsed out of it (~200 bytes each,
    # of ~35 in the blob): crafted blobs of many regions held ~6 times the bound.
    import collections
    import gc
    import tracemalloc

    from rdt_async.transports.nixl import _check

    def field(tag: bytes, data: bytes) -> bytes:
        return tag + struct.pack("<Q", len(data)) + data + b"|"

    def blob(salt: int, n: int) -> bytes:  # n regions of 4 KiB, apart (none merge)
        regions = b"".join(field(b"", struct.pack("<QQQ", (salt << 40) + (i << 13), 4096, 0) + bytes(11)) for i in range(n))
        return b"nixlSerDes|" + field(b"Agent", f"rdt-h-{os.getpid()}-0badcafe".encode()) + field(b"Conns", struct.pack("<Q", 0)) + (
            field(b"", b"MemSection") + field(b"nixlSecElms", struct.pack("<Q", 1)) + field(b"bknd", b"UCX")
            + field(b"nixlDList", b"nixlSDList") + field(b"t", struct.pack("<I", 0)) + field(b"n", struct.pack("<Q", n)) + regions
        )

    limit = 1 << 20  # (PARSED_BYTES, scaled down)
    for cache in (_check.parse_blob, _check._index):
        monkeypatch.setattr(cache, "_limit", limit)
        monkeypatch.setattr(cache, "_done", collections.OrderedDict())
        monkeypatch.setattr(cache, "nbytes", 0)
    blobs = [blob(salt, 1000) for salt in range(40)]  # ~45 KiB each
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for data in blobs:
            assert len(_check.parse_blob(data).regions) == 1000
            assert len(_check._index((data,))[0][("DRAM", 0)][0]) == 1000
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before  # (the blobs are alive anyway)
    finally:
        tracemalloc.stop()
    assert held < 2 * limit, f"{held >> 10} KiB held beyond the blobs, past two caches of {limit >> 10} KiB"


@pytest.mark.skipif("nixl" not in TRANSPORTS, reason="nixl not selected")
async def test_nixl_buffers_a_cancelled_read_may_still_write_are_refused_to_later_fetches(monkeypatch):
    # A cancelled fetch whose READ into the caller's buffers NIXL would not end leaves
    # them to the caller, who may fetch into them again: that fetch returned them, and the
    # first READ could land in them after (a value changing under its user).
    from rdt_async.transports.nixl import _xfer

    monkeypatch.setattr(_xfer, "ABORT_GRACE_S", 0.5)
    with own_producer("nixl") as p:
        assert_same(await fetch(p, p.make(8, LOOP_READ)), expect(8, LOOP_READ))  # connected
        info = p.make(9, LOOP_READ)
        buffers = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in info.specs]
        nx = _registry.transport("nixl").agent().nixl
        with nixl_stalling(nx, until_removed=None) as (posted, removed):
            assert await cancel_after(fetch(p, info, buffers), 0.3) == "cancelled"
        assert len(posted) == 1 and removed.count(info.meta.agent) == 1, (posted, removed)  # kept, never ended
        again = [buffers[0][1:]]  # (any view of them)
        with pytest.raises(rdt.TransferAbortedError, match=r"into= tensor 0 takes a READ .*NIXL may still write it") as raised:
            await fetch(p, p.make(10, (LOOP_READ[0] - 1,)), again)
        assert type(raised.value).__name__ == "StillWriting", raised.value
        assert_same(await fetch(p, p.make(11, LOOP_READ)), expect(11, LOOP_READ))  # into memory of its own: as before
