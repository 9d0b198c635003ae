"""The node relay: consumers of one node share one transfer of a remote object.

The first half runs `_relay.fetch` with a stand-in for the network read (a unit test of
the core: the claim, the memfd handed over a real unix socket, fallbacks), in one
process and across two; the second runs real consumers on the other host of the
session's cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import multiprocessing
import os
import secrets
import socket
import time
from unittest import mock

import pytest
import torch
from probes import open_fds

from rdt_async import _io, _relay
from rdt_async.transports import _mappings
from rdt_async.transports._base import TensorSpec

SPECS = [TensorSpec((1 << 18,), torch.float32, "cpu", 1 << 20), TensorSpec((3, 5), torch.int64, "cpu", 120)]


def _values(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 << 18, generator=g), torch.arange(15).view(3, 5) * (seed + 1)]


class Network:
    """Stands in for a transport: counts reads, may fail or stall."""

    def __init__(self, fail: bool = False, stall: float = 0.0) -> None:
        self.reads = 0
        self.fail, self.stall = fail, stall

    async def __call__(self):
        self.reads += 1
        await asyncio.sleep(self.stall)
        if self.fail:
            raise OSError("the link broke")
        return _values()


def _fds() -> set[str]:
    _io.io_loop()  # its own descriptors (selector, wake-up pipe) are there for good
    # A source file is open for a moment whenever a warning or traceback is formatted in
    # some thread (linecache): never one a relay peer sent (CI saw test_relay.py's own).
    return {f"{fd} -> {link}" for fd, link in open_fds().items() if not link.endswith(".py")}


def _obj_id() -> str:
    return secrets.token_hex(8)


_SEAT = _relay._seat


def _seats_apart() -> None:
    """Name this process's seats apart from other test processes' (`RDT_TEST_SEATS`, which a
    spawned child inherits): seats are the node's, and another xdist worker's test keeping
    a memfd of SPECS' size warm would look like a warm neighbour here."""
    tag = os.environ["RDT_TEST_SEATS"]
    _relay._seat = lambda cap, source, i: _SEAT(cap, tag + source, i)


def _src() -> str:
    """This test's producer name for the seats it looks at: a memfd of an earlier test that
    comes back to the pool late (a claim keeps it for late askers a while) holds a seat of
    its own producer's name, never this one's."""
    return os.environ["RDT_TEST_SEATS"]


@pytest.fixture(autouse=True)
def no_warm_memfds(monkeypatch):
    """Each test starts with no warm memfd (nor kept mapping of one) in this process, and
    leaves none; idle ones stay warm for the test's length unless it says otherwise. Its
    seats are its own (`_seats_apart`)."""
    monkeypatch.setenv("RDT_SHM_IDLE_S", "30")
    monkeypatch.setenv("RDT_RELAY_FOLLOW", "1")  # whatever this machine's cores (`_follows`)
    monkeypatch.setenv("RDT_TEST_SEATS", secrets.token_hex(4))
    monkeypatch.setattr(_relay, "_seat", _relay._seat)  # restored after the test
    _seats_apart()
    _mappings.cache.clear()
    _relay.memfds.clear()
    _mappings._get_kernel()  # its pagemap descriptor, open for the process's life, is not the test's
    yield
    _quiet()
    _mappings.cache.clear()
    _relay.memfds.clear()


def _quiet(within: float = 5.0) -> None:
    """Wait (a while at most) until no claim of this process answers and nobody maps a memfd
    of it: one that came back to the pool after the teardown's clear (its claim keeps it for
    late askers, an asker's connection closes on the I/O loop) was warm in the next test."""
    deadline = time.monotonic() + within
    while True:
        _io.settle()
        with _relay.counts.lock:
            busy = bool(_relay.counts.claims or _relay.counts.lent)
        if not busy or time.monotonic() > deadline:
            return
        gc.collect()  # (only then: one costs ~0.3 s here, most tests leave nothing busy)
        time.sleep(0.02)


async def test_two_consumers_share_one_read_and_keep_their_writes_to_themselves(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.5")  # a claim's keep after the read (2 s by default)
    before = _fds()
    net, obj = Network(stall=0.05), _obj_id()
    (a, a_relayed), (b, b_relayed) = await asyncio.gather(
        _relay.fetch(obj, SPECS, net), _relay.fetch(obj, SPECS, net)
    )
    assert net.reads == 1  # one read, copied into a memfd for the one who asked
    assert (a_relayed, b_relayed) == (False, True)
    want = _values()
    for got in (a, b):
        assert [t.shape for t in got] == [torch.Size([1 << 18]), torch.Size([3, 5])]
        assert [t.dtype for t in got] == [torch.float32, torch.int64]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    a[0].fill_(7.0)
    b[1].zero_()
    assert torch.equal(b[0], want[0]) and torch.equal(a[1], want[1])  # copy-on-write
    assert float(a[0].sum()) == 7.0 * (1 << 18)
    del a, b, got  # each mapping keeps a descriptor of the memfd (Python's mmap)
    await asyncio.sleep(0.5 + 0.3)  # the claim's keep, and a margin
    # Nobody maps the memfd any more (b's connection closed with its mapping): it is back
    # in the pool, warm, with its descriptor and the writable mapping's, and the seat that
    # says so to the node (a socket); nothing else is left.
    assert len(_relay.memfds.idle) == 1
    _mappings.cache.clear()  # a copy-on-write mapping of it may be kept for the next object (RDT_SHM_IDLE_S)
    left = sorted(x.split(" -> ")[1] for x in _fds() - before)
    assert left[:2] == ["/memfd:rdt-relay (deleted)"] * 2 and len(left) == 3 and left[2].startswith("socket:")
    _relay.memfds.clear()
    assert _fds() <= before, _fds() - before  # the claim, the memfd and every socket are closed


class Landing:
    """Stands in for a transport that reads into given buffers (tcp): counts reads."""

    def __init__(self, seed: int) -> None:
        self.reads, self.seed = 0, seed

    async def __call__(self, buffers, landed=None):
        self.reads += 1
        await asyncio.sleep(0.05)
        for b, v in zip(buffers, _values(self.seed)):
            b.copy_(v)
        return buffers  # (tells of no range: the others copy what was not told of at DONE)

    async def own(self):
        raise AssertionError("a landing transport is read into the memfd, not its own memory")


class Stepping(Landing):
    """A landing read that tells of each range as it lands (tcp does, per stream): the first
    tensor in four steps, each once the test lets it (`go`), then the second."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.go = [asyncio.Event() for _ in range(4)]
        self.told: list[tuple[int, int, int]] = []

    async def __call__(self, buffers, landed=None):
        self.reads += 1
        want = [v.reshape(-1).view(torch.uint8) for v in _values(self.seed)]
        raw = [b.reshape(-1).view(torch.uint8) for b in buffers]
        step = want[0].numel() // 4
        for k in range(4):
            await self.go[k].wait()
            raw[0][k * step : (k + 1) * step].copy_(want[0][k * step : (k + 1) * step])
            self._tell(landed, 0, k * step, step)
        raw[1].copy_(want[1])
        self._tell(landed, 1, 0, want[1].numel())
        return buffers

    def _tell(self, landed, *told) -> None:
        self.told.append(told)
        if landed is not None:
            landed(*told)


async def _until(cond, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not true after {within} s: {inspect.getsource(cond).strip()}"
        await asyncio.sleep(0.005)


async def test_a_consumer_fetching_into_its_buffers_copies_each_range_as_the_first_ones_read_lands_it(monkeypatch):
    """The first consumer hands its memfd over at once and tells of each range as it lands;
    a neighbour fetching `into=` copies the range into its buffers then, not after the read."""
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.3")  # (the claim's keep after the read: 2 s by default, waited for at teardown)
    net, obj = Stepping(9), _obj_id()
    want = _values(9)
    theirs, mine = ([torch.full((1 << 18,), -1.0), torch.zeros(3, 5, dtype=torch.int64)] for _ in range(2))
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, net.own, net, buffers=theirs))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(_relay.fetch(obj, SPECS, Network(fail=True), buffers=mine))
    quarter = (1 << 18) // 4
    for k in range(3):
        net.go[k].set()
        for buffers in (theirs, mine):  # the first one's own `into=` too
            upto = (k + 1) * quarter
            await _until(lambda b=buffers, n=upto: torch.equal(b[0][:n], want[0][:n]))
            assert torch.all(buffers[0][upto:] == -1.0), f"copied beyond what landed after step {k}"
        assert not first.done() and not second.done()
    net.go[3].set()
    (a, a_relayed), (b, b_relayed) = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (net.reads, a_relayed, b_relayed) == (1, False, True)
    assert all(x is m for x, m in zip(a, theirs)) and all(x is m for x, m in zip(b, mine)), "into= given back as it is"
    assert all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, want))
    assert len(net.told) == 5


def test_consumers_follow_the_read_by_default_only_with_cores_to_spare(monkeypatch):
    monkeypatch.delenv("RDT_RELAY_FOLLOW")
    for cores, follows in ((2, False), (3, False), (4, True), (64, True)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert _relay._follows() is follows
    monkeypatch.setenv("RDT_RELAY_FOLLOW", "1")
    assert _relay._follows()
    monkeypatch.setenv("RDT_RELAY_FOLLOW", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert not _relay._follows()


async def test_where_consumers_do_not_follow_they_copy_once_the_read_ended(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_FOLLOW", "0")
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.3")  # (as above)
    net, obj = Stepping(3), _obj_id()
    mine = [torch.full((1 << 18,), -1.0), torch.zeros(3, 5, dtype=torch.int64)]
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, net.own, net))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(_relay.fetch(obj, SPECS, Network(fail=True), buffers=mine))
    for go in net.go[:3]:
        go.set()
    await asyncio.sleep(0.2)
    assert torch.all(mine[0] == -1.0)  # nothing copied while it lands
    net.go[3].set()
    (a, _), (b, relayed) = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert relayed and all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, _values(3)))
    assert b[0].data_ptr() != mine[0].data_ptr()  # views of the memfd: the core copies them into `into=`


async def test_ranges_nobody_told_of_are_copied_once_every_byte_landed(monkeypatch):
    """A transport that tells of no range (or a fallback's): the follower copies all at DONE."""
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.3")  # (as above)
    net, obj = Landing(4), _obj_id()
    mine = [torch.zeros(1 << 18), torch.zeros(3, 5, dtype=torch.int64)]
    (a, _), (b, b_relayed) = await asyncio.gather(
        _relay.fetch(obj, SPECS, net.own, net), _relay.fetch(obj, SPECS, Network(fail=True), buffers=mine)
    )
    assert b_relayed and all(x is m for x, m in zip(b, mine))
    assert all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, _values(4)))


async def test_a_follower_whose_claimer_fails_midway_reads_for_itself_into_the_same_buffers():
    net, obj = Stepping(2), _obj_id()
    mine = [torch.zeros(1 << 18), torch.zeros(3, 5, dtype=torch.int64)]
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, net.own, net))
    await asyncio.sleep(0.05)

    class Own(Network):
        async def __call__(self):
            for b, v in zip(mine, await super().__call__()):
                b.copy_(v)
            return mine

    own = Own()
    second = asyncio.ensure_future(_relay.fetch(obj, SPECS, own, buffers=mine))
    net.go[0].set()
    await _until(lambda: bool(mine[0][0] != 0))
    first.cancel()
    b, relayed = await asyncio.wait_for(second, 10)
    assert (relayed, own.reads) == (False, 1)
    assert all(x is m for x, m in zip(b, mine)) and all(torch.equal(x, w) for x, w in zip(b, _values()))
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_follower_cancelled_midway_lets_go_of_the_memfd_and_the_first_read_goes_on(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    net, obj = Stepping(5), _obj_id()
    mine = [torch.zeros(1 << 18), torch.zeros(3, 5, dtype=torch.int64)]
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, net.own, net))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(_relay.fetch(obj, SPECS, Network(fail=True), buffers=mine))
    net.go[0].set()
    await _until(lambda: bool(mine[0][0] != 0))
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await _until(lambda: _relay.stats()["memfds_lent"] == 1)  # the first read's own hold alone
    for go in net.go[1:]:
        go.set()
    a, relayed = await asyncio.wait_for(first, 10)
    assert not relayed and all(torch.equal(x, w) for x, w in zip(a, _values(5)))
    del a, first  # (the task holds its result)
    await _until(lambda: _relay.stats()["memfds_lent"] == 0 and _relay.stats()["idle_memfds"] == 1)


async def _round(seed: int, source: str = ""):
    """Two consumers of this process fetch one object through the relay, landing it in a memfd."""
    net, obj = Landing(seed), _obj_id()
    (a, a_relayed), (b, b_relayed) = await asyncio.gather(
        _relay.fetch(obj, SPECS, net.own, net, source=source), _relay.fetch(obj, SPECS, net.own, net, source=source)
    )
    assert net.reads == 1 and sorted((a_relayed, b_relayed)) == [False, True]
    return a, b


async def test_a_landing_read_hands_over_warm_memory_and_reuses_it_only_once_nobody_maps_it(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    a, b = await _round(1)
    want = _values(1)
    assert all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, want))
    a[0].fill_(7.0)  # the first reader's own tensors are copy-on-write too
    assert torch.equal(b[0], want[0])
    del a
    await asyncio.sleep(0.3)  # b still maps the memfd
    assert _relay.memfds.idle == []
    c, d = await _round(2)  # so the next object lands in another memfd
    assert torch.equal(b[0], want[0]) and torch.equal(b[1], want[1]), "a memfd in use was reused"
    assert all(torch.equal(x, w) for got in (c, d) for x, w in zip(got, _values(2)))
    del b, c, d
    await asyncio.sleep(0.3)
    assert len(_relay.memfds.idle) == 2  # both back, warm
    warm = list(_relay.memfds.idle)
    e, f = await _round(3)
    (taken,) = [m for m in warm if m not in _relay.memfds.idle]  # reused: no new memfd made
    assert len(_relay.memfds.idle) == 1  # e's and f's mappings hold the one taken
    assert all(torch.equal(x, w) for got in (e, f) for x, w in zip(got, _values(3)))
    del e, f, taken, warm
    await asyncio.sleep(0.3)
    assert len(_relay.memfds.idle) == 2  # all back: nothing of this test outlives it


async def test_a_fetch_into_buffers_lands_in_a_memfd_only_where_one_is_warm(monkeypatch):
    """`warm_only` (a fetch with `into=`): with no warm memfd, the first consumer reads into
    its own buffers (fresh memory costs more than the copy it would save) and copies them
    for who asked; with one, it lands the bytes there, for the others to map at once."""
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    own, net = Network(stall=0.05), Landing(6)
    obj = _obj_id()
    (a, _), (b, _) = await asyncio.gather(
        *(_relay.fetch(obj, SPECS, own, net, warm_only=True) for _ in range(2))
    )
    assert (own.reads, net.reads) == (1, 0)
    assert all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, _values()))
    del a, b
    await asyncio.sleep(0.3)
    assert len(_relay.memfds.idle) == 1  # the copy made for who asked: warm now
    obj = _obj_id()
    (c, _), (d, _) = await asyncio.gather(
        *(_relay.fetch(obj, SPECS, own, net, warm_only=True) for _ in range(2))
    )
    assert (own.reads, net.reads) == (1, 1)
    assert all(torch.equal(x, w) for got in (c, d) for x, w in zip(got, _values(6)))


def _warm_then_claim(obj: str, ready, go) -> None:
    """Keep a warm memfd the size of SPECS (its seat says so to the node); once told, fetch
    `obj` landing in it, and hand it to who asks until killed."""

    _seats_apart()

    async def main():
        _relay.memfds.give(_relay.memfds.take(_relay._layout(SPECS)[1], _src()))
        ready.set()
        await asyncio.to_thread(go.wait, 60)
        net = Landing(8)
        _mine, relayed = await _relay.fetch(obj, SPECS, net.own, net, warm_only=True, source=_src())
        assert (net.reads, relayed) == (1, False)
        await asyncio.sleep(60)

    asyncio.run(main())


async def test_a_cold_consumer_lets_a_warm_neighbour_claim_first_and_alone_on_its_node_waits_for_none(monkeypatch):
    """A consumer fetching `into=` with no warm memfd waits for a neighbour with one to claim
    the object only where a process of its node says it has one that last held an object
    of the same producer; alone, or beside warm readers of other producers, it claims at
    once (it waited 20 ms on every fetch: 28 ms for 4 MiB across hosts where 4 sufficed)."""
    cap = _relay.memfds.capacity(_relay._layout(SPECS)[1])
    own, net = Network(), Landing(6)
    waited = _relay.counts.done["waited_for_warm"]
    assert not _relay._Seats.taken(cap, _src())
    alone, relayed = await _relay.fetch(_obj_id(), SPECS, own, net, warm_only=True, source=_src())
    assert (own.reads, net.reads, relayed) == (1, 0, False)  # read into its own buffers at once
    assert _relay.counts.done["waited_for_warm"] == waited and _relay.memfds.idle == []
    del alone

    monkeypatch.setattr(_relay, "COLD_WAIT_S", 30.0)  # (the neighbour is a process to start)
    monkeypatch.setattr(_relay, "COLD_WAIT_MAX_S", 30.0)
    ctx = multiprocessing.get_context("spawn")
    ready, go, obj = ctx.Event(), ctx.Event(), _obj_id()
    warm = ctx.Process(target=_warm_then_claim, args=(obj, ready, go), daemon=True)
    warm.start()
    try:
        assert await asyncio.to_thread(ready.wait, 60)
        assert _relay._Seats.taken(cap, _src()) and not _relay._Seats.taken(cap * 2, _src())
        assert not _relay._Seats.taken(cap, "another-producer")
        other, relayed = await _relay.fetch(_obj_id(), SPECS, own, net, warm_only=True, source="another-producer")
        assert (own.reads, relayed) == (2, False)  # warm from other objects: no wait for it
        assert _relay.counts.done["waited_for_warm"] == waited
        del other
        asking = asyncio.ensure_future(_relay.fetch(obj, SPECS, own, net, warm_only=True, source=_src()))
        await asyncio.sleep(0.3)
        assert not asking.done() and own.reads == 2  # it lets the warm one claim
        go.set()
        tensors, relayed = await asyncio.wait_for(asking, 30)
        assert (own.reads, net.reads, relayed) == (2, 0, True)  # mapped the neighbour's memfd
        assert all(torch.equal(t, w) for t, w in zip(tensors, _values(8)))
        assert _relay.counts.done["waited_for_warm"] == waited + 1
        del tensors
    finally:
        warm.kill()
        warm.join(10)
    assert not _relay._Seats.taken(cap, _src())  # its seat went with it


async def test_a_process_says_which_capacities_it_keeps_warm_and_no_longer_once_they_go(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    cap = _relay.memfds.capacity(_relay._layout(SPECS)[1])
    assert not _relay._Seats.taken(cap, _src())
    a, b = await _round(9, _src())
    del a, b
    await asyncio.sleep(0.3)
    assert len(_relay.memfds.idle) == 1 and _relay._Seats.taken(cap, _src())  # back, warm: said
    taken = _relay.memfds.take(_relay._layout(SPECS)[1], _src())
    assert not _relay._Seats.taken(cap, _src())  # in use: no longer warm
    _relay.memfds.give(taken)
    assert _relay._Seats.taken(cap, _src())
    _relay.memfds.clear()
    assert not _relay._Seats.taken(cap, _src())


def _in_forked_child(inherited, parent_inode: int, out) -> None:
    """What a forked child's relay keeps of its parent's warm memfd (sent on `out`)."""
    size = _relay._layout(SPECS)[1]
    cap = _relay.memfds.capacity(size)
    got = {"idle": len(_relay.memfds.idle), "seats": len(_relay.memfds.seats.held),
           "parent_seat_seen": _relay._Seats.taken(cap, _src())}
    mine = _relay.memfds.take(size)
    got["new_memfd"] = os.fstat(mine.fd).st_ino != parent_inode
    _relay.memfds.give(inherited)  # a lease of the parent's, released here: dropped, not pooled
    got["after_give"] = [os.fstat(m.fd).st_ino == parent_inode for m in _relay.memfds.idle]
    out.send(got)


def test_a_forked_child_never_reuses_its_parents_warm_memfds():
    """A child forked from a process with warm memfds would otherwise take the same memfd
    as its parent for two objects at once, one's bytes over the other's under a mapping."""
    size = _relay._layout(SPECS)[1]
    warm = _relay.memfds.take(size, _src())
    _relay.memfds.give(warm)
    assert _relay.memfds.idle == [warm] and _relay._Seats.taken(_relay.memfds.capacity(size), _src())
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_in_forked_child, args=(warm, os.fstat(warm.fd).st_ino, there))
    child.start()
    try:
        assert here.poll(30)
        got = here.recv()
    finally:
        child.join(10)
    assert got == {"idle": 0, "seats": 0, "parent_seat_seen": True, "new_memfd": True, "after_give": []}
    assert child.exitcode == 0
    assert _relay.memfds.idle == [warm] and _relay._Seats.taken(_relay.memfds.capacity(size), _src())  # the parent's, as they were


def _read_after_parent_let_go(view: torch.Tensor, go, out) -> None:
    """In a forked child: what `view` (inherited) reads once the parent has read another
    object (sent on `out`)."""
    go.recv()
    out.send(float(view[0]))


async def test_a_forked_child_keeps_what_the_first_consumer_mapped_after_the_parent_lets_go(monkeypatch):
    """The first consumer's own copy-on-write views of its memfd are held by an in-process
    lease; a child forked meanwhile inherits the views, and where the parent then let go,
    the memfd went back to the pool and the next object landed in it: under the child's
    tensor. A memfd lent at a fork is closed when its lease ends, never reused."""
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0")
    ctx = multiprocessing.get_context("fork")
    mine, _ = await _relay.fetch(_obj_id(), SPECS, Network(fail=True), Landing(1))
    here, there = ctx.Pipe()
    go_parent, go_child = ctx.Pipe()
    child = ctx.Process(target=_read_after_parent_let_go, args=(mine[0], go_child, there))
    child.start()
    try:
        want = float(mine[0][0])
        del mine
        await _until(lambda: not _relay.counts.lent)  # let go here: the lease is spent
        other, _ = await _relay.fetch(_obj_id(), SPECS, Network(fail=True), Landing(2))  # another object, same size
        assert float(other[0][0]) == float(_values(2)[0][0]) != want
        go_parent.send("read")
        assert here.poll(30)
        assert here.recv() == want  # what the child took is still the first object
    finally:
        child.join(10)
    assert child.exitcode == 0


async def test_a_cancel_as_the_first_read_ends_leaves_nothing_writing_its_into_buffers(monkeypatch):
    """The first consumer, fetching `into=` its buffers, copies each range the read tells of
    (`_Copier`). A cancel arriving one loop turn after the read returned used to end the
    fetch with the copier still running: it wrote the buffers after `CancelledError`, from
    a memfd that meanwhile went back to the pool and held the next object's bytes."""
    monkeypatch.setenv("RDT_RELAY_FOLLOW", "1")
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0")
    n = 64 << 20
    specs = [TensorSpec((n,), torch.uint8, "cpu", n)]
    into = torch.zeros(n, dtype=torch.uint8)
    me: dict = {}

    async def read_then_cancelled(views, landed=None):
        views[0].fill_(7)
        for off in range(0, n, 8 << 20):
            landed(0, off, 8 << 20)  # as tcp's streams tell of each step
        asyncio.get_running_loop().call_soon(me["task"].cancel)
        return views

    async def other_object(views, landed=None):
        views[0].fill_(9)
        return views

    me["task"] = asyncio.ensure_future(_relay.fetch(_obj_id(), specs, Network(fail=True), read_then_cancelled, buffers=[into]))
    with pytest.raises(asyncio.CancelledError):
        await me["task"]
    written = into.clone()
    other, _ = await _relay.fetch(_obj_id(), specs, Network(fail=True), other_object)
    await asyncio.sleep(0.3)
    assert torch.equal(into, written), "written after the cancel"
    assert not bool((into == 9).any()), "the next object's bytes reached the cancelled fetch's buffers"
    assert not [t for t in asyncio.all_tasks() if "_Copier._run" in repr(t)], "a copier left running"
    del other


async def test_a_neighbour_that_asks_as_a_failed_claim_ends_reads_for_itself_at_once():
    """A claim whose read failed ends (`_Server.end`) while a neighbour's connection waits
    in its backlog: the neighbour was handed the half-landed memfd as a follower, and then
    nobody told it anything more: it waited out its bound (30 s and more) before reading
    for itself. It gets EOF at once."""
    size = _relay._layout(SPECS)[1]
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    claim.bind(b"\0rdt-test-claim-" + secrets.token_hex(8).encode())
    claim.listen(8)
    claim.setblocking(False)
    server = _relay._Server(claim, _obj_id())
    memfd = _relay.memfds.take(size, _src())
    lease = _relay._Lease(memfd)
    lease.hold()  # the claim's, while it lands
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.landing(lease, size)  # (not started: the neighbour stays in the backlog)
        asker.connect(claim.getsockname())
        server.end(lease)  # the read failed
        asker.settimeout(5)
        msg, fds, _, _ = socket.recv_fds(asker, 1 << 16, 4)
        assert (msg, fds) == (b"", []), "handed a memfd by a claim that had ended"
    finally:
        asker.close()
    await _until(lambda: not _relay.counts.lent)  # the memfd went back: nobody holds it


async def test_an_idle_memfd_is_closed_on_its_own(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.5")
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())  # no sweep of earlier tests' pending (30 s)
    before = _fds()
    a, b = await _round(4)
    assert all(torch.equal(x, w) for got in (a, b) for x, w in zip(got, _values(4)))
    del a, b
    await asyncio.sleep(0.3)
    assert len(_relay.memfds.idle) == 1  # back, warm
    _mappings.cache.clear()  # kept mappings of it are _mappings' to sweep, not the pool's
    await _until(lambda: _relay.memfds.idle == [], 0.9)  # nothing uses the pool again: the sweep alone closes it
    assert not [fd for fd in _fds() - before if "memfd:rdt-relay" in fd]


async def test_a_subscription_keeps_its_producers_newest_warm_memfd_past_the_idle_time_and_the_bound(monkeypatch):
    """A version every 30 s would land each time in fresh memory: while a subscription here
    follows a producer, the newest idle memfd of each capacity of that producer's objects
    stays (this process holding the node's first seat of it), whatever the bound on idle
    bytes; the others go as before, and it goes once the subscription does."""
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    monkeypatch.setattr(_relay, "MAX_IDLE_BYTES", 0)  # nothing is kept for reuse but a subscription's
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())  # no sweep of earlier tests' pending (30 s)
    size, pool = _relay._layout(SPECS)[1], _relay.memfds
    cap = pool.capacity(size)
    release = pool.want(_src())
    older, newest, other = pool.take(size, _src()), pool.take(size, _src()), pool.take(size, "another producer")
    older_ino, newest_ino, other_ino = (os.fstat(m.fd).st_ino for m in (older, newest, other))
    pool.give(older)
    assert pool.idle == [older] and _relay._Seats.taken(cap, _src())  # kept past the bound, and said
    pool.give(newest)  # the newest is kept now: the older one is over the bound, closed at once
    pool.give(other)  # nobody follows its producer: over the bound, closed at once
    assert pool.idle == [newest] and older_ino not in _open_inodes() and other_ino not in _open_inodes()
    await asyncio.sleep(1.0)  # three idle times: still kept
    assert pool.idle == [newest] and _relay._Seats.taken(cap, _src())
    assert pool.warm(size) and not pool.warm(4 * cap)
    taken = pool.take(size, _src())
    assert taken is newest  # the next version lands in it: warm
    pool.give(taken)
    release()
    release()  # (twice: once counts)
    assert pool.wanted == {}  # (and a stream's subscription keeps a few: `want(source, each)`)
    # (the sweep closes what it lets go of in the pool, off the loop: wait for that too)
    await _until(lambda: pool.idle == [] and newest_ino not in _open_inodes(), 1.0)
    assert not _relay._Seats.taken(cap, _src())


async def test_a_subscription_keeps_memory_for_its_versions_sizes_not_for_another_object_of_its_producer(monkeypatch):
    """A trainer that also returns a one-off object (a checkpoint of 8 GiB) through the
    relay: a subscription to its weights keeps the memfd of a version's size, not that one."""
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    monkeypatch.setattr(_relay, "MAX_IDLE_BYTES", 0)  # nothing is kept for reuse but a subscription's
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    size, pool = _relay.size_of(SPECS), _relay.memfds
    release = pool.want(_src(), 1, [size])
    version, checkpoint = pool.take(size, _src()), pool.take(4 * pool.capacity(size), _src())
    checkpoint_ino = os.fstat(checkpoint.fd).st_ino
    pool.give(version)
    pool.give(checkpoint)  # over the bound, and no subscription's size: closed at once
    assert pool.idle == [version] and checkpoint_ino not in _open_inodes()
    await asyncio.sleep(1.0)
    assert pool.idle == [version]  # past the idle time: kept
    release()
    await _until(lambda: pool.idle == [], 1.0)


def test_a_subscription_expecting_a_version_says_so_where_it_keeps_the_memory_it_lands_in(monkeypatch):
    """On a busy node the subscribers of one trainer hear of a version tens of ms apart: one
    with no warm memory must wait for the claim of the one that keeps it (else it reads into
    fresh memory), longer than the usual 20 ms, but only while that one expects a version."""
    monkeypatch.setattr(_relay, "MAX_IDLE_BYTES", 0)
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    pool, size = _relay.memfds, _relay.size_of(SPECS)
    cap = pool.capacity(size)
    release = pool.want(_src(), 1, [size])
    pool.give(pool.take(size, _src()))
    assert _relay._Seats.taken(cap, _src()) and not _relay._Seats.kept(cap, _src())  # kept, not expecting
    expected = pool.expect(_src())
    assert _relay._Seats.kept(cap, _src())
    assert not _relay._Seats.kept(cap, "another producer")
    taken = pool.take(size, _src())  # its claim (bound first) takes the memfd: the mark goes with it
    assert not _relay._Seats.kept(cap, _src())
    pool.give(taken)
    assert _relay._Seats.kept(cap, _src())
    expected()
    expected()  # (twice: once counts)
    assert not _relay._Seats.kept(cap, _src()) and pool.expecting == {}
    release()


def test_a_forked_childs_copy_of_a_subscription_lets_go_of_nothing_the_child_wants(monkeypatch):
    """A forked child inherits the parent's subscriptions (their releases, not yet run): one
    collected in the child must not take away what the child's own subscription keeps."""
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    pool, size = _relay.memfds, _relay.size_of(SPECS)
    inherited = pool.want(_src(), 1, [size])
    pool.forked()  # (what a fork runs in the child)
    own = pool.want(_src(), 1, [size])  # the child's subscription, asking for the same
    inherited()  # the inherited copy is collected in the child
    assert [each for each, _, _ in pool.wanted[_src()]] == [1]
    own()
    assert pool.wanted == {}


async def test_with_keep_warm_off_a_subscription_keeps_nothing_past_the_idle_time(monkeypatch):
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    monkeypatch.setenv("RDT_RELAY_KEEP_WARM", "0")
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    pool = _relay.memfds
    release = pool.want(_src())
    pool.give(pool.take(_relay._layout(SPECS)[1], _src()))
    assert pool.wanted == {} and len(pool.idle) == 1  # (within the bound: idle, for now)
    await _until(lambda: pool.idle == [], 1.0)
    release()


async def test_a_streaming_subscription_keeps_as_many_memfds_of_a_size_as_it_fetches_at_once(monkeypatch):
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    monkeypatch.setattr(_relay, "MAX_IDLE_BYTES", 0)
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    size, pool = _relay._layout(SPECS)[1], _relay.memfds
    one, three = pool.want(_src()), pool.want(_src(), 3)
    ms = [pool.take(size, _src()) for _ in range(4)]
    for m in ms:
        pool.give(m)
        await asyncio.sleep(0.01)  # (the newest given last)
    await asyncio.sleep(1.0)
    assert pool.idle == ms[1:]  # the three newest: what its most asking subscription fetches at once
    three()
    await asyncio.sleep(1.0)
    assert pool.idle == ms[3:]  # the other subscription keeps one
    one()
    await _until(lambda: pool.idle == [], 1.0)


def test_a_memfd_kind_taken_at_a_steady_cadence_stays_warm_between_takes(monkeypatch):
    """As shm's segments: an object of one producer and size fetched every ~0.6 s (a
    hand-written weight sync's step) lands in the same memfd, though the idle time is
    0.3 s; a one-off goes after the idle time; with RDT_SHM_IDLE_S set, that is the keep time."""
    from rdt_async.transports import _segments

    monkeypatch.delenv("RDT_SHM_IDLE_S", raising=False)
    monkeypatch.setattr(_segments, "idle_s", lambda: 0.3)
    monkeypatch.setattr(_relay, "memfds", _relay._Memfds())
    size, pool = _relay._layout(SPECS)[1], _relay.memfds
    made = []

    def step(source: str, nbytes: int = size) -> None:
        m = pool.take(nbytes, source)
        made.append(os.fstat(m.fd).st_ino)
        pool.give(m)

    step(_src())
    for _ in range(3):
        time.sleep(0.6)  # twice the idle time between takes
        step(_src())
    assert len(set(made)) == 2, made  # the first, and one more before the cadence was known
    assert pool.cadence.keep_s((pool.capacity(size), _src())) == pytest.approx(1.2, abs=0.3)
    step("a one-off producer", 4 * pool.capacity(size))  # (another capacity: the steady one's memfd is not taken)
    time.sleep(0.7)
    assert [m.source for m in pool.idle] == [_src()]  # the one-off went; the steady one waits
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    assert pool.cadence.keep_s((pool.capacity(size), _src())) == 0.3  # set: exact
    pool.clear()


def test_a_subscription_keeps_a_memfd_only_where_no_other_process_of_the_node_says_it_keeps_one(monkeypatch):
    """At most one warm memfd of a kind a node: a process whose seat is not the first (another
    said before it that it keeps one) lets its own go at the idle time."""
    monkeypatch.setattr(_relay, "MAX_IDLE_BYTES", 0)
    size = _relay._layout(SPECS)[1]
    cap = _relay.memfds.capacity(size)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.bind(_relay._seat(cap, _src(), 0))  # a neighbour's seat, said first
    try:
        release = _relay.memfds.want(_src())
        m = _relay.memfds.take(size, _src())
        ino = os.fstat(m.fd).st_ino
        _relay.memfds.give(m)
        assert _relay.memfds.idle == [] and ino not in _open_inodes()
        release()
    finally:
        first.close()


async def test_a_subscription_keeps_the_newest_mapping_of_its_producers_memfds_past_the_idle_time(monkeypatch):
    """An asker maps the node's warm memfd of each version: its mapping (warm page tables)
    stays with it, tagged by the producer, while a subscription here follows that producer."""
    if not _mappings._keeps():
        pytest.skip("this kernel keeps no mapping (no PAGEMAP_SCAN)")
    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.3")
    monkeypatch.setattr(_mappings, "cache", _mappings.MappingCache())  # no sweep of earlier tests' pending (30 s)
    size = _relay._layout(SPECS)[1]
    files = [_relay._Memfds().take(size) for _ in range(3)]
    release = _relay.memfds.want(_src())  # (the relay's pool tells the mappings)
    try:
        for m, tag in zip(files, (_src(), _src(), "another producer")):
            views = _relay._private(m.fd, SPECS, _relay._layout(SPECS)[0], mock.Mock(), tag)
            del views
            await asyncio.sleep(0.01)  # (in order: the newest is the last one of the tag)
        _io.settle()
        assert _mappings.cache.stats()["idle"] == 3
        await asyncio.sleep(1.0)
        assert _mappings.cache.stats()["idle"] == 1  # the newest of the followed producer's
        views = _relay._private(files[1].fd, SPECS, _relay._layout(SPECS)[0], mock.Mock(), _src())
        assert _mappings.cache.reused == 1  # mapped through it
        del views
    finally:
        release()
    await _until(lambda: _mappings.cache.stats()["idle"] == 0, 1.0)
    for m in files:
        _relay._close(m)


def _open_inodes() -> set[int]:
    """The inodes of this process's open descriptors (a memfd's mapping keeps one of its own)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return out


async def test_a_consumer_arriving_after_the_claim_ended_reads_again(monkeypatch):
    monkeypatch.setenv("RDT_RELAY_KEEP_S", "0.1")
    net, obj = Network(), _obj_id()
    first, _ = await _relay.fetch(obj, SPECS, net)
    assert not [fd for fd in _fds() if "memfd:rdt-relay" in fd]  # nobody asked: no copy made
    await asyncio.sleep(0.3)
    second, relayed = await _relay.fetch(obj, SPECS, net)
    assert (net.reads, relayed) == (2, False)
    assert torch.equal(first[0], second[0])


async def test_when_the_first_read_fails_the_others_read_for_themselves():
    broken, fine, obj = Network(fail=True, stall=0.05), Network(), _obj_id()
    first, second = await asyncio.gather(
        _relay.fetch(obj, SPECS, broken), _relay.fetch(obj, SPECS, fine), return_exceptions=True
    )
    assert isinstance(first, OSError) and "the link broke" in str(first)
    tensors, relayed = second
    assert (broken.reads, fine.reads, relayed) == (1, 1, False)
    assert torch.equal(tensors[0], _values()[0])


async def test_when_the_first_read_is_cancelled_the_others_read_for_themselves():
    slow, fine, obj = Network(stall=10), Network(), _obj_id()
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, slow))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(_relay.fetch(obj, SPECS, fine))
    await asyncio.sleep(0.05)
    first.cancel()
    tensors, relayed = await asyncio.wait_for(second, 5)
    assert first.cancelled() and (fine.reads, relayed) == (1, False)
    assert torch.equal(tensors[1], _values()[1])


def _hold_claim_then_die(obj: str, claimed) -> None:
    async def main():
        async def stuck():
            claimed.set()
            await asyncio.sleep(60)

        await _relay.fetch(obj, SPECS, stuck)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _claimed_elsewhere(target):
    """A process of this node running `target(obj, claimed)`; yield (process, obj) once it claimed obj."""
    ctx = multiprocessing.get_context("spawn")
    obj, claimed = _obj_id(), ctx.Event()
    holder = ctx.Process(target=target, args=(obj, claimed), daemon=True)
    holder.start()
    try:
        assert await asyncio.to_thread(claimed.wait, 60)
        yield holder, obj
    finally:
        holder.kill()
        holder.join(10)


async def test_when_the_first_consumers_process_dies_the_others_read_for_themselves():
    async with _claimed_elsewhere(_hold_claim_then_die) as (holder, obj):
        net = Network()
        asking = asyncio.ensure_future(_relay.fetch(obj, SPECS, net))
        await asyncio.sleep(0.2)
        assert not asking.done() and net.reads == 0  # it waits for the holder's read
        t0 = time.monotonic()
        holder.kill()
        tensors, relayed = await asyncio.wait_for(asking, 10)
        assert time.monotonic() - t0 < 5
        assert (net.reads, relayed) == (1, False)
        assert torch.equal(tensors[0], _values()[0])


async def test_a_consumer_stuck_in_its_read_holds_the_others_only_so_long(monkeypatch, caplog):
    """The claimer alive but its read stuck: who asked reads for itself after a bound that
    scales with the object (30 s + its bytes at 25 MB/s), not never."""
    monkeypatch.setattr(_relay, "ASK_MIN_S", 0.3)
    assert _relay._ask_bound(25_000_000) == pytest.approx(1.3)
    stuck, fine, obj = Network(stall=30), Network(), _obj_id()
    first = asyncio.ensure_future(_relay.fetch(obj, SPECS, stuck))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    tensors, relayed = await asyncio.wait_for(_relay.fetch(obj, SPECS, fine), 10)
    took = time.monotonic() - t0
    assert 0.3 <= took < 3 and (fine.reads, relayed) == (1, False)
    assert torch.equal(tensors[0], _values()[0]) and not first.done()
    assert f"the consumer of this node reading object {obj} did not hand it over in 0.342 s" in caplog.text
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


def _squat_as_nobody(obj: str, bound) -> None:
    """Hold the object's claim as another user, handing out a forged memfd."""
    import socket

    os.setuid(65534)
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    claim.bind(_relay._address(obj))
    claim.listen(8)
    bound.set()
    size = _relay._layout(SPECS)[1]
    forged = os.memfd_create("forged")  # zeros, the size the asker expects
    os.ftruncate(forged, size)
    while True:
        conn, _ = claim.accept()
        socket.send_fds(conn, [b'{"obj_id": "%s", "size": %d}' % (obj.encode(), size)], [forged])
        conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
async def test_a_claim_held_by_another_user_is_not_trusted():
    async with _claimed_elsewhere(_squat_as_nobody) as (_, obj):
        net = Network()
        tensors, relayed = await asyncio.wait_for(_relay.fetch(obj, SPECS, net), 10)
        assert (net.reads, relayed) == (1, False)  # read for itself
        assert torch.equal(tensors[0], _values()[0])


def _squat_seats_as_nobody(obj: str, bound) -> None:
    """Hold every seat of SPECS' capacity as another user: the node looks warm, and no
    warm consumer of ours will ever claim."""
    import socket

    _seats_apart()
    cap = _relay.memfds.capacity(_relay._layout(SPECS)[1])
    names = [_relay._seat(cap, _src(), i) for i in range(_relay.SEATS)]  # our user's (the uid is in them)
    os.setuid(65534)
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in names]
    for name, sock in zip(names, held):
        sock.bind(name)
    bound.set()
    time.sleep(60)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
async def test_seats_held_by_another_user_cost_a_cold_consumer_its_bounded_wait_and_no_more():
    async with _claimed_elsewhere(_squat_seats_as_nobody) as (_, obj):
        assert _relay._Seats.taken(_relay.memfds.capacity(_relay._layout(SPECS)[1]), _src())
        own, net = Network(), Landing(7)
        waited = _relay.counts.done["waited_for_warm"]
        t0 = time.monotonic()
        tensors, relayed = await asyncio.wait_for(_relay.fetch(obj, SPECS, own, net, warm_only=True, source=_src()), 10)
        assert time.monotonic() - t0 < 1.0  # its wait: 20 ms for an object this size
        assert (own.reads, net.reads, relayed) == (1, 0, False)  # then it read for itself
        assert _relay.counts.done["waited_for_warm"] == waited + 1
        assert all(torch.equal(t, w) for t, w in zip(tensors, _values()))


def test_only_remote_cpu_objects_of_a_mib_or_more_go_through_the_relay(monkeypatch):
    big, small = SPECS, [TensorSpec((16,), torch.float32, "cpu", 64)]
    cuda = [TensorSpec((1 << 18,), torch.float32, "cuda:0", 1 << 20)]
    assert _relay.eligible(big, "nixl", "node-a", "node-b")
    assert not _relay.eligible(big, "nixl", "node-a", "node-a")  # same node: shm maps it already
    assert not _relay.eligible(small, "nixl", "node-a", "node-b")
    assert not _relay.eligible(cuda, "nixl", "node-a", "node-b")
    assert not _relay.eligible(big, "inline", "node-a", "node-b")
    monkeypatch.setenv("RDT_RELAY", "0")
    assert not _relay.eligible(big, "nixl", "node-a", "node-b")


# -- real consumers on the other host ------------------------------------------------------


@pytest.fixture(scope="module")
def node2_servers(cluster):
    """Servers on node2's host, made as this module's tests ask for them (`_servers`) and
    shared by them (each test's fetches replace what the servers hold; `ray_session`
    checks each for leaks): each is a process that imports torch."""
    import ray

    made: list = []
    yield made
    for actor in made:
        ray.kill(actor)


@pytest.fixture
def fan_out(sync_producer, node2_servers):
    """The session's producer on the head host and four servers on node2's."""
    return sync_producer, _servers(node2_servers, 4)


@pytest.fixture
def one_server(sync_producer, node2_servers):
    """The session's producer and one server on node2's, which starts cold: no server of
    the node keeps warm memory from an earlier test (what they held is let go, and idle
    memfds close after RDT_SHM_IDLE_S, 1 s in this session)."""
    import ray
    from conftest import wait_until

    servers = _servers(node2_servers, 1)
    ray.get([s.drop.remote() for s in node2_servers])

    def idle() -> list[int]:
        return [r["idle_memfds"] for r in ray.get([s.relay_stats.remote() for s in node2_servers])]

    wait_until(lambda: not any(idle()), 15, idle)
    return sync_producer, servers


def _servers(made: list, k: int) -> list:
    """The first `k` of the module's servers on node2, made where fewer are."""
    from conftest import ON_NODE2

    while len(made) < k:
        made.append(_server_class().options(**ON_NODE2).remote())
    return made[:k]


@functools.cache
def _server_class():
    import rdt_async as rdt

    @rdt.remote
    class Server:
        async def load(self, refs, at: float):
            obj = await refs[0]  # the RDTObject in hand; all fetch at once, at `at`
            await asyncio.sleep(max(0.0, at - time.time()))
            before = rdt.store_stats()["fetches"]
            self.ran = [time.time()]
            self.w = (await rdt.fetch(obj))["w"]
            self.ran.append(time.time())
            after = rdt.store_stats()["fetches"]
            return float(self.w.double().sum()), {
                k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)
            }

        async def load_into(self, refs, at: float):
            """The same, into buffers of this actor's: (sum, fetches, landed in them)."""
            obj = await refs[0]
            buf = {"w": torch.empty(obj.specs[0].shape)}
            await asyncio.sleep(max(0.0, at - time.time()))
            before = rdt.store_stats()
            self.ran = [time.time()]
            got = await rdt.fetch(obj, into=buf)
            self.ran.append(time.time())
            after = rdt.store_stats()
            fetches = {
                k: n - before["fetches"].get(k, 0)
                for k, n in after["fetches"].items()
                if n > before["fetches"].get(k, 0)
            }
            self.relay = {
                k: after["relay"][k] - before["relay"][k]
                for k in ("claimed", "landed", "copied", "unanswered", "refused", "gave_up")
            }
            return float(got["w"].double().sum()), fetches, got["w"].data_ptr() == buf["w"].data_ptr()

        async def relay_did(self):
            """What the relay of this process did in the last `load_into`."""
            return self.relay

        async def fetch_ran(self):
            """When the last `load_into`'s fetch started and ended (time.time())."""
            return self.ran

        async def load_into_twice(self, refs):
            """Each object in turn, fetched twice at once into two buffers of this process:
            [(sums, what the relay did)] (one after the other). Idle memfds go after
            RDT_SHM_IDLE_S, 1 s in this session: 30 s meanwhile, or on a loaded machine the
            first's memfd could go before the second asks (seen with two pytest-xdist workers)."""
            objs = [await r for r in refs]
            bufs = [{"w": torch.zeros(objs[0].specs[0].shape)} for _ in range(2)]
            out = []
            with mock.patch.dict(os.environ, {"RDT_SHM_IDLE_S": "30"}):  # (read at each sweep)
                for obj in objs:
                    before = rdt.store_stats()["relay"]
                    got = await asyncio.gather(*(rdt.fetch(obj, into=b) for b in bufs))
                    after = rdt.store_stats()["relay"]
                    assert all(g["w"].data_ptr() == b["w"].data_ptr() for g, b in zip(got, bufs))
                    did = {k: after[k] - before[k] for k in ("claimed", "landed", "copied", "handed", "mapped")}
                    out.append(([float(g["w"].double().sum()) for g in got], did))
                    del got
                    await asyncio.sleep(0.2)  # the second's mapping goes: the memfd is back, warm
            return out

        async def scribble(self) -> None:
            self.w.fill_(-1.0)

        async def kept_sum(self) -> float:
            return float(self.w.double().sum())

        async def drop(self) -> None:
            self.w = None

        async def relay_stats(self) -> dict:
            return rdt.store_stats()["relay"]

    return Server


@pytest.mark.parametrize("transport", ["auto", "object_store"])
def test_consumers_on_another_host_share_one_transfer_and_own_their_copies(fan_out, transport, ray_session):
    import ray

    if ray_session.hosts is None:
        pytest.skip("node2 runs on this host (no namespaces here): nothing crosses hosts")
    producer, servers = fan_out
    n = 8 << 20  # 32 MiB of float32
    make = producer.value if transport == "auto" else producer.value_os
    warm = make.remote({"w": torch.ones(1 << 20)})
    ray.get([s.load.remote([warm], 0.0) for s in servers], timeout=60)  # each process's first fetch sets up
    del warm
    for seed in (3, 4, 5, 6, 7):
        want = float(torch.randn(n, generator=torch.Generator().manual_seed(seed)).double().sum())
        ref = make.remote({"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))})
        ray.wait([ref], timeout=60)  # produced: the four start together however long that took
        at = time.time() + 1.5
        loaded = ray.get([s.load.remote([ref], at) for s in servers], timeout=60)
        assert [round(total, 1) for total, _ in loaded] == [round(want, 1)] * 4
        ran = ray.get([s.fetch_ran.remote() for s in servers])
        first = min(ran)  # the claimer's (start, end)
        del ref
        if sum(start < first[1] for start, _ in ran) >= 3:
            break
        # Woken late on a loaded machine: fewer than two others asked while the read ran.
        # That round says nothing of sharing; another does.
    else:
        pytest.fail("the four consumers never fetched at once in five rounds")
    used = [next(iter(fetches)) for _, fetches in loaded]
    # One read crossed the link; who asked while it ran mapped it (all, but for a straggler).
    assert 2 <= used.count("relay") <= 3, (used, ran)
    assert len({u for u in used if u != "relay"}) == 1, used
    ray.get(servers[0].scribble.remote())
    assert ray.get([s.kept_sum.remote() for s in servers]) == pytest.approx([-n] + [want] * 3)


@pytest.mark.parametrize("transport", ["auto", "object_store"])
def test_consumers_fetching_into_their_own_buffers_share_one_transfer(fan_out, transport, ray_session):
    """`into=` fetches go through the relay too: they copy from its memfd into theirs (over
    a transport that lands bytes where it reads them, the first reads into its buffers and
    copies them into a memfd for who asked)."""
    import ray

    if ray_session.hosts is None:
        pytest.skip("node2 runs on this host (no namespaces here): nothing crosses hosts")
    producer, servers = fan_out
    make = producer.value if transport == "auto" else producer.value_os
    n = 8 << 20
    warm = make.remote({"w": torch.ones(n)})
    ray.get(
        [s.load_into.remote([warm], 0.0) for s in servers], timeout=60
    )  # each process's first fetch sets up
    del warm
    rounds = 0
    unshared: list = []
    for seed in (3, 4, 5, 6, 7):  # twice: the second reuses warm memfds and kept mappings
        want = float(torch.randn(n, generator=torch.Generator().manual_seed(seed)).double().sum())
        ref = make.remote({"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))})
        ray.wait([ref], timeout=60)  # produced: the four start together however long that took
        at = time.time() + 1.5
        loaded = ray.get([s.load_into.remote([ref], at) for s in servers], timeout=60)
        assert [round(total, 1) for total, _, _ in loaded] == [round(want, 1)] * 4
        assert all(landed for _, _, landed in loaded)  # in each consumer's own buffers
        ran = ray.get([s.fetch_ran.remote() for s in servers])
        first = min(ran)  # the claimer's (start, end)
        if sum(start < first[1] for start, _ in ran) < 3:
            # Woken late on a loaded machine: fewer than two others asked while the read ran
            # (over the object store, one reading into its buffers copies only for those).
            # That round says nothing of sharing; another does.
            del ref
            continue
        used = [next(iter(fetches)) for _, fetches, _ in loaded]
        assert used.count("relay") <= 3 and len({u for u in used if u != "relay"}) == 1, (used, ran)
        if used.count("relay") < 2:
            # Under load (CI's two workers on 2 cores) a round has been seen, about once in
            # several full runs, where the four started within 2 ms and two of the three
            # read for themselves: not explained yet (the closing notes track it). Such a
            # round is not judged; two rounds of five must share, as before.
            unshared.append((used, ran, ray.get([s.relay_did.remote() for s in servers])))
            del ref
            continue
        if transport == "object_store":
            did = ray.get([s.relay_did.remote() for s in servers])
            assert (sum(d["landed"] for d in did), sum(d["copied"] for d in did)) == (0, 1), did
        del ref
        rounds += 1
        if rounds == 2:
            break
    assert rounds == 2, ("the four consumers never shared one transfer twice in five rounds", unshared)


def test_into_fetches_over_tcp_land_in_a_warm_memfd_that_the_others_map_at_once(one_server, cluster):
    """Over tcp, once a consumer of the node has warm memory for the object, it claims the
    read and lands the bytes in a memfd that the others map as soon as the read ends, as
    fetches without `into=` do; not in its own buffers and then, while the others wait,
    into a fresh memfd for them (4.9 s where 1.2 s sufficed for 512 MiB to 8: issue 29).
    With no warm memfd, the first reads into its own buffers (fresh memory would cost more)."""
    import ray

    if cluster.hosts is None:
        pytest.skip("node2 runs on this host (no namespaces here): nothing crosses hosts")
    producer, servers = one_server
    n = 8 << 20
    values = [torch.randn(n, generator=torch.Generator().manual_seed(seed)) for seed in (3, 4)]
    refs = [producer.value.remote({"w": v}) for v in values]
    loaded = ray.get(servers[0].load_into_twice.remote(refs), timeout=120)
    for seed, v, (sums, did) in zip((3, 4), values, loaded):
        assert [round(s, 1) for s in sums] == [round(float(v.double().sum()), 1)] * 2
        assert (did["claimed"], did["handed"], did["mapped"]) == (1, 1, 1), did
        if seed == 3:  # cold: read into the first's buffers, copied into a memfd for the second
            assert (did["landed"], did["copied"]) == (0, 1), did
        else:  # that memfd is warm now: the read lands there
            assert (did["landed"], did["copied"]) == (1, 0), did


async def test_a_claimer_that_cannot_map_its_own_copy_gives_the_memfd_back(monkeypatch):
    before = _fds()
    net, obj = Landing(5), _obj_id()

    def no_memory(fd, hold, tag=""):
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as m:
        m.setattr(_mappings.cache, "open", no_memory)
        with pytest.raises(OSError, match="Cannot allocate memory"):
            await _relay.fetch(obj, SPECS, net.own, net)
    await asyncio.sleep(0.1)  # the claim ends on the I/O loop, and lets go of its memfd there
    assert net.reads == 1 and len(_relay.memfds.idle) == 1  # back, warm
    _relay.memfds.clear()
    assert not [fd for fd in _fds() - before if "memfd:rdt-relay" in fd]
