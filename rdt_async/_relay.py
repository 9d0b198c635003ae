"""Node relay: the consumers of one node share one transfer of an object from another node.

A weight sync to eight inference actors on a node would otherwise move the object over
the link eight times (Ray's object store pulls an object to a node once). The first
consumer on a node to fetch a remote CPU object claims it by binding an abstract unix
socket named after the object -- one process of the node (of its network namespace)
can hold the name, and it goes away with that process -- and reads it as any fetch
does -- over tcp straight into a memfd, which it maps itself; over other transports,
or into its caller's `into=` buffers, where that fetch puts it, copied into a memfd only
if other consumers of the node asked meanwhile. It hands the memfd (SCM_RIGHTS) to
them, and to those who ask while the claim lasts (RDT_RELAY_KEEP_S after the read,
default 2 s) and someone still maps it; they map it copy-on-write: no copy, and a
consumer's writes stay its own (one fetching `into=` copies from it and lets it go).
Where consumers follow the read (`_follows`: 4 cores or more) and it lands in the memfd,
the memfd is handed over at once, and each range as it lands (`Transport.reports_landed`:
tcp): a consumer fetching `into=` -- the first one too -- copies each range into its
buffers meanwhile, so that copies overlap the read.
Nobody asking costs the first consumer nothing. Both ends check that the other runs as the same user (SO_PEERCRED).
What an asker receives is input: it maps only one memfd, sealed against shrinking and
growing (the first consumer seals each it makes: nobody can cut it under a mapping, a
SIGBUS), as large as the layout of its own ref's specs; its answer must be exactly the
object asked for and its size. Anything else (garbage, more descriptors, none, an early
close) and it reads for itself, closing every descriptor it was sent.

Memfds are warm and pooled (`_Memfds`): one is reused only once nobody maps it any
more (`_Lease`), so no consumer can see another object's bytes. A process says which
sizes it keeps warm (`_Seats`), so that a cold consumer lets a warm one claim first only
where one is there. When the first
consumer's read fails, is cancelled or its process dies, the others read for
themselves. A fetch with `device=` takes no part. A relayed fetch sees the
bytes as the first consumer read them (a producer writing a kept tensor in place while
refs exist gives no other guarantee; see `wait_tensor_freed`).

Runs on: consumer. Off with RDT_RELAY=0; objects under RELAY_MIN_BYTES are not relayed.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import select
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from . import _io
from ._local import aligned_layout, view_in
from .transports import _mappings, _registry, _segments
from .transports._base import TensorSpec

RELAY_MIN_BYTES = 1 << 20
ALIGN = 64
MAX_IDLE_BYTES = 1 << 30  # warm memfds kept for reuse, in all
# A consumer with no warm memory for an object lets a warm one of its node claim it first,
# where one says it is there (`_Seats`): for at least COLD_WAIT_S, longer for a large object
# (a fresh memfd faults in at ~1-2.6 GiB/s here: an eighth of what a cold claim can cost), at
# most COLD_WAIT_MAX_S.
COLD_WAIT_S = 0.02
COLD_WAIT_PER_GIB_S = 0.125
COLD_WAIT_MAX_S = 0.25
COLD_STEP_S = 0.004
KEPT_WAIT_S = 1.0  # the same, where the warm one keeps it for a subscription that expects this version
FOLLOW_MIN_CORES = 4  # by default consumers fetching `into=` follow the read on this many cores or more (`_follows`)
SEATS = 4  # processes of a node that say they have warm memory of one capacity (one suffices)
ASK_MIN_S = 30.0  # an asker waits at least this long for the claimer's read (see _ask_bound)
MAX_ANSWER = 4096  # bytes of the claimer's first message an asker reads (an answer of ~60, ranges)
_FRAME = struct.Struct("<I")  # an answer's length, before the answer (JSON) and the ranges landed so far
_RANGE = struct.Struct("<IQQ")  # a range of the object that landed: tensor index, byte offset, bytes
_ALL = 0xFFFFFFFF
DONE = _RANGE.pack(_ALL, 0, 0)  # every byte landed: the last thing the claimer sends
# A memfd's size is fixed once made (a pooled one is reused at its capacity): sealed, so
# nobody holding it (or reopening it through /proc) can shrink it under an asker's
# mapping -- a read past a file's end is a SIGBUS -- and an asker takes only one so sealed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
log = logging.getLogger("rdt_async")


class _Counts:
    """What this process's relay did (counters) and holds now: `stats()`. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = dict.fromkeys(
            ("claimed", "landed", "copied", "handed", "mapped", "waited_for_warm", "unanswered", "refused", "gave_up"), 0
        )
        self.claims: set[_Server] = set()  # open: answering who asks
        self.lent: set[_Lease] = set()  # memfds someone maps

    def add(self, what: str) -> None:
        with self.lock:
            self.done[what] += 1


counts = _Counts()


def stats() -> dict[str, int]:
    """This process's relay: reads it did for its node (`claimed`: straight into a memfd,
    `landed`, or copied into one after the read for who asked, `copied`), memfds it handed to
    neighbours (`handed`) and mapped from one (`mapped`), fetches that let a warm neighbour
    claim first (`waited_for_warm`), asks of a neighbour's claim that ended with this process
    reading for itself (`unanswered`: its read failed, or it ended without handing the
    object over; `refused`: an answer we could not take; `gave_up`: none in time); and what
    it holds now: open claims, memfds lent out, idle warm memfds and their bytes."""
    _io.settle()  # memfds whose last mapping went just now are back
    with memfds.lock:
        idle, idle_bytes = len(memfds.idle), sum(m.capacity for m in memfds.idle)
    with counts.lock:
        return {**counts.done, "claims_open": len(counts.claims), "memfds_lent": len(counts.lent),
                "idle_memfds": idle, "idle_bytes": idle_bytes}


def _keep_s() -> float:
    return float(os.environ.get("RDT_RELAY_KEEP_S", "2"))


def eligible(specs: Sequence[TensorSpec], transport: str, producer_node: str, node: str) -> bool:
    """Whether a fetch of these tensors over `transport` may go through the node relay: not
    one that never crosses nodes (`Transport.reach`), nor one whose bytes came with the ref."""
    return (
        producer_node != node
        and _crosses_nodes(transport)
        and sys.platform == "linux"
        and os.environ.get("RDT_RELAY", "1") != "0"
        and sum(s.nbytes for s in specs) >= RELAY_MIN_BYTES
        and all(torch.device(s.device).type == "cpu" for s in specs)
    )


def _crosses_nodes(name: str) -> bool:
    cls = _registry.known_class(name)  # (None for "local", "none": not a transport)
    return cls is not None and cls.reach == "cluster" and not cls.carries_bytes


def _layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    offsets, size = aligned_layout((s.nbytes for s in specs), ALIGN)
    return offsets, max(size, ALIGN)  # a memfd of 0 bytes cannot be mapped


def _views(buffer: Any, specs: Sequence[TensorSpec], offsets: list[int]) -> list[torch.Tensor]:
    return [view_in(buffer, s, off) for s, off in zip(specs, offsets)]


def _private(fd: int, specs: Sequence[TensorSpec], offsets: list[int], holder: Any, source: str = "") -> list[torch.Tensor]:
    """Map the memfd copy-on-write: views that read its bytes and keep their own writes.

    `holder` (the lease of our own memfd, or our connection to the one who lent it) is
    released once no view is left. The mapping is kept for the next handing-out of the
    same memfd (transports/_mappings.py: warm page tables, our old writes dropped), past
    the idle time while a subscription here follows `source` (the object's producer).
    """
    buf = _mappings.cache.open(fd, None, source)
    if isinstance(holder, _Lease):
        holder.hold()  # a new lease: never spent yet
        _io.finalize(buf, holder.release)
    else:
        _io.finalize(buf, holder.close)
    return _views(buf, specs, offsets)


def _same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of `sock` runs as our user (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


def _address(obj_id: str) -> bytes:
    return b"\0rdt-relay-" + obj_id.encode()


async def fetch(
    obj_id: str,
    specs: Sequence[TensorSpec],
    transfer: Callable[[], Awaitable[list[torch.Tensor]]],
    transfer_into: Callable[..., Awaitable[list[torch.Tensor]]] | None = None,
    *,
    warm_only: bool = False,
    source: str = "",
    buffers: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], bool]:
    """Fetch through the node's relay: `(tensors, True)` when another consumer read them.

    `transfer()` reads the object over the network, landing it where its transport does
    (a caller's `into=` buffers); `transfer_into(buffers, landed=cb)`, where given, lands it
    in `buffers` (a transport whose cancel never writes them afterwards) and tells `cb` of
    each range as it lands (`TransferInfo.landed`): then the first consumer reads straight
    into warm memory it hands over at once, with no copy, and the others follow it range
    by range (copying into their `into=`), or map it as soon as the read ends.
    `warm_only`: `transfer_into` only where this process has a warm memfd for the object
    (a caller whose `into=` buffers are warm already: landing in fresh memory would cost
    more than the copy it saves). `source`: who made the object
    (`source_of` its producer): a consumer with no warm memfd lets one that last read an
    object of that producer into one claim it first. `buffers`: the caller's `into=`; where
    another consumer reads the object and hands over each range as it lands, this one
    copies it there meanwhile, and gets `buffers` back.
    """
    follows = _follows()
    follow = _followable(buffers, specs) if follows else None
    offsets, size = _layout(specs)
    if transfer_into is not None and not memfds.warm(size):
        # Fresh memory faults in slowly: a consumer of the node that has warm memory for
        # the object (it read one of this size from the same producer before: a version
        # of the same weights) claims it first, where one says it is there. (One that
        # lands the bytes in its transport's memory never waits, nor one with nobody to
        # wait for: alone on its node, or beside warm readers of other producers.)
        got = _NO_CLAIM
        cap = memfds.capacity(size)
        if _Seats.taken(cap, source):
            counts.add("waited_for_warm")
            wait = max(KEPT_WAIT_S, _cold_wait_s(size)) if _Seats.kept(cap, source) else _cold_wait_s(size)
            got = await _ask_within(obj_id, specs, wait, follow, source)
        if got is not _NO_CLAIM:
            return (got, True) if got is not None else (await transfer(), False)
        if warm_only:
            transfer_into = None
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(_address(obj_id))
        claim.listen(128)  # at once: a neighbour connecting between bind and listen is refused, and reads for itself
    except OSError:
        claim.close()  # another consumer of this node holds the object, or is reading it
        got = await _ask(obj_id, specs, follow, source)
        if got is not None and got is not _NO_CLAIM:
            return got, True
        return await transfer(), False
    return await _serve(claim, obj_id, specs, (offsets, size), transfer, transfer_into, source, follows, follow), False


async def _serve(
    claim: socket.socket,
    obj_id: str,
    specs: Sequence[TensorSpec],
    layout: tuple[list[int], int],
    transfer: Callable[[], Awaitable[list[torch.Tensor]]],
    transfer_into: Callable[..., Awaitable[list[torch.Tensor]]] | None,
    source: str,
    follows: bool = False,
    follow: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Read the object for this node; hand a memfd of it to the consumers that ask.

    With `transfer_into` the bytes land in a warm memfd, and this consumer's own tensors
    map it copy-on-write too; with `follows` (consumers follow the read, `_follows`) the
    memfd is handed over at once, and each range as it lands (`Transport.reports_landed`;
    every byte at the end otherwise). Otherwise the transfer
    lands where the transport puts it, as any fetch's (so a cancel ends it as promptly as
    any), and the memfd costs a copy only where another consumer waits for it.

    With `follow` (this consumer's `into=`, `_followable`) and `transfer_into`, it copies
    each range into `follow` as it lands, as the others do, and returns `follow`. Without
    `follows`, the memfd is handed over once the read ended, and no range is told: on 2
    cores the early answer and the ranges cost 8 consumers of 256 MiB `into=` ~0.1 s.
    """
    offsets, size = layout
    claim.setblocking(False)
    server = _Server(claim, obj_id)
    counts.add("claimed")
    _io.call_soon(server.start)
    memfd: _Memfd | None = None
    lease: _Lease | None = None
    try:
        if transfer_into is not None:
            memfd = memfds.take(size, source)
            lease = _Lease(memfd)
            lease.hold()  # the claim's, while it lands (and askers follow it range by range, where they do)
            if follows:
                _io.call_soon(server.landing, lease, size)
            views = _views(memfd.mm, specs, offsets)
            own = None if follow is None else _Copier(views, follow)

            def landed(i: int, off: int, n: int) -> None:  # on the transport's threads
                _io.call_soon(server.landed, i, off, n)
                if own is not None:
                    own.landed(i, off, n)

            try:
                got = await transfer_into(views, landed=landed if follows else None)  # nothing writes it after a cancel
            finally:
                if own is not None:
                    await own.finish()  # no copy of ours runs past this
            del got  # views of the writable mapping: this consumer gets a copy-on-write one, or its own
            counts.add("landed")
            if own is not None:
                await _io.to_thread_finished(_copy_ranges, views, own.into, _untold(own.copied, specs))
                mine = own.into
            else:
                mine = _private(memfd.fd, specs, offsets, lease, source)  # askers get it while anyone maps it
        else:
            mine = await transfer()
            # Copied where a neighbour waits, or where a subscription here follows the producer:
            # its next version then lands in warm memory, and a neighbour that hears of this
            # one late (a busy node) maps this copy instead of reading it over the link again.
            if server.asked() or source in memfds.wanted:
                memfd = memfds.take(size, source)
                await _io.to_thread_finished(_publish, memfd, mine, specs, offsets)
                counts.add("copied")
                lease = _Lease(memfd)
                lease.hold()  # the claim's: a copy nobody maps yet, kept until who asked has it
    except BaseException:
        if transfer_into is not None and lease is not None:
            _io.call_soon(server.end, lease)  # who followed reads for itself; the memfd goes back once they let go
            raise
        _io.call_soon(server.end)
        if memfd is not None and (lease is None or lease.holders == 0):
            if lease is not None:
                with counts.lock:
                    counts.lent.discard(lease)
            memfds.give(memfd)  # handed to nobody (mapping our own copy may fail): warm for the next read
        raise
    if lease is None:
        _io.call_soon(server.end)  # nobody else wants it: later askers read for themselves
    else:
        _io.call_soon(server.ready, lease, size)
    return mine


class _Copier:
    """Copies each range of `views` into `into` as the read tells of it (`landed`, from any
    thread), off the loop, one copy at a time; `copied` holds the (start, end) spans done."""

    def __init__(self, views: list[torch.Tensor], into: list[torch.Tensor]) -> None:
        self.views, self.into = views, into
        self.copied: list[list[tuple[int, int]]] = [[] for _ in views]
        self.loop = asyncio.get_running_loop()
        self.queue: list[tuple[int, int, int]] = []
        self.wake = asyncio.Event()
        self.ending = False
        self.task = asyncio.ensure_future(self._run())

    def landed(self, i: int, off: int, n: int) -> None:
        self.loop.call_soon_threadsafe(self._add, (i, off, n))

    def _add(self, told: tuple[int, int, int]) -> None:
        self.queue.append(told)
        self.wake.set()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            ranges, self.queue = self.queue, []
            if ranges:
                await _io.to_thread_finished(_copy_ranges, self.views, self.into, ranges)
                for i, off, n in ranges:
                    self.copied[i].append((off, off + n))
            if self.ending and not self.queue:
                return

    async def finish(self) -> None:
        """Copy what was told of so far, and stop: nothing of ours writes `into` once this
        returns or raises. A cancel meanwhile waits for that, then is raised."""

        async def last() -> None:
            await asyncio.sleep(0)  # what the transport's threads told of just before it returned
            self.ending = True
            self.wake.set()
            await self.task

        cancelled = await _io.shielded(last())
        if cancelled:
            raise asyncio.CancelledError
        if not self.task.cancelled():
            self.task.result()  # a copy that failed fails the fetch


def _publish(memfd: _Memfd, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], offsets: list[int]) -> None:
    """Copy `tensors` into `memfd` at the relay's layout."""
    for view, t in zip(_views(memfd.mm, specs, offsets), tensors):
        view.copy_(t)


@dataclasses.dataclass(eq=False)
class _Memfd:
    """A memfd and this process's writable mapping of it."""

    fd: int
    capacity: int
    mm: mmap.mmap
    idle_since: float = 0.0
    source: str = ""  # the producer of the object it last held (`source_of`)
    pid: int = dataclasses.field(default_factory=os.getpid)  # whose pool reuses it (a fork's child never)
    # Lent when this process forked: a child may map it through views it inherited, which
    # would show the next object's bytes; closed when its lease ends, never reused.
    forked: bool = False

    @property
    def kind(self) -> tuple[int, str]:
        """What a seat says of it: (capacity, source)."""
        return self.capacity, self.source


class _Memfds:
    """This process's warm memfds, reused once nothing maps them copy-on-write any more.

    Bounded (MAX_IDLE_BYTES idle in all) and shrinking: one idle for RDT_SHM_IDLE_S
    seconds (default 10) is closed, or unless that is set, where its kind (capacity and
    producer) is taken again and again, for up to twice the time between takes (120 s at
    most), as shm's segments (`_segments.Cadence`). Capacities are powers of two (a memfd allocates only
    the pages written).

    Except the newest memfd (or few: `want`) per capacity of the versions of each
    producer a live subscription of this process follows, where this process is its node's first warm one
    of that kind (its seat says so): a version every 30 s would otherwise land each time in
    fresh memory, which faults in at a fraction of a warm copy's speed. Those stay,
    whatever their size, until the last subscription to that producer here goes.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Memfd] = []
        self.seats = _Seats()
        self.cadence = _segments.Cadence()  # of each kind: one taken again and again stays warm between takes
        # Producers (`source_of`) live subscriptions here follow: `want`'s `each` and capacities, one a
        # subscription (and a token of its own: a forked child's copy of a subscription lets go of its own only).
        self.wanted: dict[str, list[tuple[int, frozenset[int], object]]] = {}
        # Of those, the producers a subscription here waits for the next version of, until it
        # fetched it (`expect`): a neighbour with no warm memory waits longer for this process's claim.
        self.expecting: dict[str, int] = {}
        self._sweeper = _segments.IdleSweep(self._sweep, lambda: _segments.idle_s())

    @staticmethod
    def capacity(size: int) -> int:
        return max(RELAY_MIN_BYTES, 1 << (size - 1).bit_length())

    def warm(self, size: int) -> bool:
        cap = self.capacity(size)
        _io.settle()  # memfds whose last view went just now are back
        with self.lock:
            return any(m.capacity == cap for m in self.idle)

    def take(self, size: int, source: str = "") -> _Memfd:
        """A warm memfd for `size` bytes (else a new one), for an object of `source`."""
        cap = self.capacity(size)
        _segments.idle_s()  # (a bad RDT_SHM_IDLE_S fails here, not when the memfd is given back)
        _io.settle()
        with self.lock:
            self.cadence.taken((cap, source))
            for i, m in enumerate(self.idle):
                if m.capacity == cap:
                    taken = self.idle.pop(i)
                    self._hold_seats()
                    taken.source = source
                    return taken
        fd = os.memfd_create("rdt-relay", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, cap)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, cap, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return _Memfd(fd, cap, mm, source=source)

    def give(self, m: _Memfd) -> None:
        if m.pid != os.getpid() or m.forked:  # the parent's, in a forked child; or mapped in a child perhaps
            _close(m)
            return
        with self.lock:
            m.idle_since = self.cadence.idle_from(m.kind)  # (later where its kind is taken at a slow, steady cadence)
            self.idle.append(m)
            self.seats.hold(self.idle)  # (first: who keeps what asks which seats this process holds)
            spared = {id(x) for x in self._spared()}  # (a subscription's, whatever its size: `m` may displace one)
            over = sum(x.capacity for x in self.idle if id(x) not in spared) - MAX_IDLE_BYTES
            out = []
            for x in sorted((x for x in self.idle if id(x) not in spared), key=lambda x: x is not m):
                if over <= 0:
                    break  # (`m` first: a memfd over the bound goes before the older ones it would push out)
                out.append(x)
                over -= x.capacity
            gone = {id(x) for x in out}
            self.idle = [x for x in self.idle if id(x) not in gone]
            self._hold_seats()
            kept = id(m) not in gone
        if kept:
            self._sweeper.start()
        for x in out:
            _close(x)

    def want(self, source: str, each: int = 1, sizes: Sequence[int] = ()) -> Callable[[], None]:
        """A subscription here follows `source`'s objects of `sizes` (bytes as the relay lays
        them out, `size_of`; none given: of any size): keep `each` warm memfds of each of
        their capacities while it lives (see the class; a stream fetches a few chunks at
        once). Another object of that producer (a one-off checkpoint of 8 GiB) is not kept.
        Returns the call that says it went. With RDT_RELAY_KEEP_WARM=0, nothing is kept past
        the idle time (the call does nothing)."""
        if os.environ.get("RDT_RELAY_KEEP_WARM", "1") == "0":
            return lambda: None
        entry = each, frozenset(self.capacity(n) for n in sizes), object()
        with self.lock:
            self.wanted.setdefault(source, []).append(entry)
        done = False

        def release() -> None:  # (any thread; never inside a finalizer: `_io.finalize`)
            nonlocal done
            if not done:
                done = True
                self._unwant(source, entry)

        return release

    def expect(self, source: str) -> Callable[[], None]:
        """A subscription here waits for `source`'s next version and will fetch it at once:
        while it does (until the call returned is made), the kept memfds of that producer say
        so to the node (`_Seats.kept`), so that a neighbour with no warm memory waits for this
        process's claim up to KEPT_WAIT_S, not COLD_WAIT_S: on a busy node subscribers hear of
        a version tens of ms apart, and the first would otherwise read into fresh memory."""
        with self.lock:
            self.expecting[source] = self.expecting.get(source, 0) + 1
            self._hold_seats()
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            with self.lock:
                left = self.expecting.pop(source, 0) - 1
                if left > 0:
                    self.expecting[source] = left
                self._hold_seats()

        return release

    def _hold_seats(self) -> None:
        """Hold the seats of the idle memfds, and the kept marks of those a subscription
        here expects a version into (under the lock)."""
        self.seats.hold(self.idle)
        self.seats.hold_kept({m.kind for m in self._spared() if self.expecting.get(m.source)})

    def _unwant(self, source: str, entry: tuple[int, frozenset[int], object]) -> None:
        with self.lock:
            left = [e for e in self.wanted.get(source, []) if e[2] is not entry[2]]  # (none: a forked child's copy)
            if left:
                self.wanted[source] = left
            else:
                self.wanted.pop(source, None)
        _mappings.cache.sweep_soon()  # (the mappings of it this process read through: `_kept_tag`)
        self._sweeper.start()  # what it kept goes once idle as long as any other

    def _spared(self) -> list[_Memfd]:
        """The idle memfds subscriptions keep (under the lock): the newest of each kind of a
        wanted producer (as many as its subscriptions ask), where this process holds that
        kind's first seat."""
        kinds: dict[tuple[int, str], list[_Memfd]] = {}
        for m in self.idle:
            if m.source in self.wanted and self.seats.first(m.kind):
                kinds.setdefault(m.kind, []).append(m)
        spared = []
        for (cap, source), ms in kinds.items():
            ms.sort(key=lambda m: m.idle_since, reverse=True)
            spared += ms[: max((each for each, caps, _ in self.wanted[source] if not caps or cap in caps), default=0)]
        return spared

    def clear(self) -> None:
        """Close every idle memfd now."""
        _io.settle()
        with self.lock:
            idle, self.idle = self.idle, []
            self._hold_seats()
        for m in idle:
            _close(m)

    def forked(self) -> None:
        """In a forked child: the idle memfds and seats are the parent's (what this process
        has are copies of its descriptors and mappings), and a lock may have been held by a
        thread that is not here. Let go of the copies: a memfd the parent may reuse is never
        reused here, where both would write it at once."""
        self.lock = threading.Lock()
        self._sweeper = _segments.IdleSweep(self._sweep, lambda: _segments.idle_s())
        idle, self.idle = self.idle, []
        self.wanted, self.expecting = {}, {}  # (the subscriptions' copies here keep nothing)
        self.seats.forget()
        for m in idle:
            _close(m)

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        with self.lock:
            spared = {id(m) for m in self._spared()}
            old = [m for m in self.idle if m.idle_since <= cutoff and id(m) not in spared]
            gone = {id(m) for m in old}
            self.idle = [m for m in self.idle if id(m) not in gone]
            self._hold_seats()
            left = _segments.oldest(m for m in self.idle if id(m) not in spared)
        _segments.let_go_off_loop(_close, old)
        return left


class _Seats:
    """This process says which capacities it has warm memfds of, and whose objects they last
    held, to the node's other consumers: it holds one of SEATS abstract unix socket names per
    (capacity, source) (bound, never listening; it goes with the process), so that a cold
    consumer waits for a warm one only where one that read from the same producer is there
    (`taken`): never alone on its node, nor for a neighbour warm from other objects.

    Another user of the node could hold our names too (abstract names have no owner): a
    cold consumer then waits its bound (`_cold_wait_s`) for nothing, no more.
    """

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], tuple[socket.socket, int]] = {}  # kind: (seat, its number)
        self.kept_held: dict[tuple[int, str], socket.socket] = {}  # kind: its kept mark (`hold_kept`)

    def hold(self, idle: Sequence[_Memfd]) -> None:
        """Hold a seat for each (capacity, source) in `idle`, none other (under the pool's lock)."""
        kinds = {m.kind for m in idle}
        for kind in [k for k in self.held if k not in kinds]:
            self.held.pop(kind)[0].close()
        for cap, source in kinds - self.held.keys():  # (every seat held: the others say it already)
            for i in range(SEATS):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(_seat(cap, source, i))
                except OSError:
                    sock.close()  # held by another warm process (or a probe, for a moment)
                    continue
                self.held[cap, source] = sock, i
                break

    def hold_kept(self, kinds: set[tuple[int, str]]) -> None:
        """Hold the kept mark of each kind in `kinds` (memfds a subscription here keeps and
        expects a version into), none other (under the pool's lock)."""
        for kind in [k for k in self.kept_held if k not in kinds]:
            self.kept_held.pop(kind).close()
        for cap, source in kinds - self.kept_held.keys():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(_kept_seat(cap, source))
            except OSError:
                sock.close()  # (another process of the node says it: enough)
                continue
            self.kept_held[cap, source] = sock

    @staticmethod
    def kept(cap: int, source: str) -> bool:
        """Whether a process of this node says it keeps a warm memfd of `cap` for `source`'s
        versions and is about to fetch the next one (`hold_kept`)."""
        return _bound(_kept_seat(cap, source)) is True

    def first(self, kind: tuple[int, str]) -> bool:
        """Whether this process holds the first seat of `kind`: no other of the node said so before it."""
        held = self.held.get(kind)
        return held is not None and held[1] == 0

    def forget(self) -> None:
        """Close this process's copies of the seats (a forked child's: the parent's stay held)."""
        held, self.held = self.held, {}
        for sock, _ in held.values():
            sock.close()
        kept, self.kept_held = self.kept_held, {}
        for sock in kept.values():
            sock.close()

    @staticmethod
    def taken(cap: int, source: str) -> bool:
        """Whether a process of this node (its network namespace) says it has a warm memfd
        of `cap` that last held an object of `source`: a seat's name is bound. Probes by
        binding each for a moment."""
        for i in range(SEATS):
            bound = _bound(_seat(cap, source, i))
            if bound is not False:
                return bound is True  # (None, out of descriptors: do not wait)
        return False


def _seat(cap: int, source: str, i: int) -> bytes:
    return b"\0rdt-relay-warm-%d-%d-%s-%d" % (os.getuid(), cap, source.encode(), i)


def _bound(name: bytes) -> bool | None:
    """Whether abstract unix socket name `name` is bound (probed by binding it for a
    moment); None where the probe itself failed."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(name)
    except OSError as exc:
        return True if exc.errno == errno.EADDRINUSE else None
    finally:
        probe.close()
    return False


def _kept_seat(cap: int, source: str) -> bytes:
    return b"\0rdt-relay-kept-%d-%d-%s" % (os.getuid(), cap, source.encode())


def size_of(specs: Sequence[TensorSpec]) -> int:
    """The bytes of a memfd holding an object of `specs` (as `want` takes them)."""
    return _layout(specs)[1]


def name_of(obj_id: str, producer: Any, transport: str, specs: Sequence[TensorSpec], meta: Any) -> str:
    """The name a node's consumers share an object's read under: its id, and a digest of
    everything the ref says about where its bytes are and what they are.

    The id alone is no key: a ref is input from another process, and one that carried an
    honest object's id with another producer or other metadata would otherwise have its
    bytes handed to every consumer of the honest object on the node (or, the other way
    round, be served the honest bytes without its own metadata ever checked).
    """
    what = repr((obj_id, producer.node_id, producer.token, producer.actor_id, transport, specs, meta))
    digest = hashlib.blake2b(what.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return f"{obj_id[:64]}/{digest}"  # (bounded: an abstract socket's name is at most 107 bytes)


def source_of(node_id: str, pid: int) -> str:
    """A producer's short name in the seats' names (its node and process)."""
    return hashlib.blake2b(f"{node_id}:{pid}".encode(), digest_size=8).hexdigest()


def _close(m: _Memfd) -> None:
    try:
        m.mm.close()
    except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
        pass
    os.close(m.fd)


class _Lease:
    """Who maps one handing-out of a memfd: the first consumer's own mapping, each asker (by
    its open connection), and the claim while it lasts where the memfd is a copy. When the
    last lets go, the memfd goes back to the pool and this lease is spent: no later asker
    can be handed it, so no mapping of it ever shows the next object's bytes."""

    def __init__(self, memfd: _Memfd) -> None:
        self.memfd = memfd
        self.lock = threading.Lock()
        self.holders = 0
        self.spent = False
        with counts.lock:
            counts.lent.add(self)

    def hold(self) -> bool:
        """One holder more; False if the memfd has gone back already."""
        with self.lock:
            if self.spent:
                return False
            self.holders += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.holders -= 1
            self.spent = self.holders == 0
        if self.spent:
            with counts.lock:
                counts.lent.discard(self)
            memfds.give(self.memfd)


memfds = _Memfds()


def _kept_tag(source: str) -> bool:
    """The mapping cache's `kept_tag`: the mappings of memfds of a producer that a
    subscription here follows stay as long as its memfds do."""
    return source in memfds.wanted


_mappings.kept_tag = _kept_tag


def _forked() -> None:
    """A forked child starts with no relay state of its own (see `_Memfds.forked`)."""
    memfds.forked()
    counts.lock = threading.Lock()
    counts.claims, counts.lent = set(), set()  # the parent's claims and leases


def _forking() -> None:
    """In the parent, before a fork: the memfds lent now may stay mapped in the child (views
    it inherits of this process's own copy-on-write mapping; an asker's connection, which the
    child inherits too, already keeps its lease held): never reuse them."""
    with counts.lock:
        for lease in counts.lent:
            lease.memfd.forked = True


os.register_at_fork(before=_forking, after_in_child=_forked)


class _Server:
    """Answers the node's other consumers of one object, on the I/O loop."""

    def __init__(self, claim: socket.socket, obj_id: str) -> None:
        self.claim, self.obj_id = claim, obj_id
        self.lock = threading.Lock()  # `waiting`: filled on the I/O loop, counted by the reader
        self.waiting: list[socket.socket] = []
        self.lease: _Lease | None = None
        self.size = 0
        self.done = False
        self.ranges: list[bytes] = []  # landed so far (`_RANGE`s), for who asks while it lands
        self.finished = False  # every byte landed: DONE follows each answer
        self.following: dict[socket.socket, _Lease] = {}  # answered while it lands: told of each range

    def asked(self) -> bool:
        """Whether another consumer waits for the object (accepted, or still in the backlog)."""
        with self.lock:
            if self.waiting:
                return True
        return bool(select.select([self.claim], [], [], 0)[0])

    def start(self) -> None:
        with counts.lock:
            counts.claims.add(self)
        asyncio.get_running_loop().add_reader(self.claim.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.claim.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not _same_user(conn):
                conn.close()  # another user of this host: the bytes are not theirs to map
            elif self.lease is not None:
                self._answer(conn)
            else:
                with self.lock:
                    self.waiting.append(conn)

    def _answer(self, conn: socket.socket) -> None:
        """Hand the memfd over with the ranges landed so far (DONE once all have); the
        asker keeps `conn` open while it maps it."""
        lease = self.lease
        assert lease is not None
        if not lease.hold():
            conn.close()  # nobody maps it any more, so it may hold another object: read for yourself
            return
        msg = json.dumps({"obj_id": self.obj_id, "size": self.size}).encode()
        first = _FRAME.pack(len(msg)) + msg + b"".join(self.ranges) + (DONE if self.finished else b"")
        try:
            socket.send_fds(conn, [first], [lease.memfd.fd])
        except OSError:
            conn.close()  # the asker gave up: nothing to answer
            lease.release()
            return
        conn.setblocking(False)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._unmapped, conn, lease)
        if not self.finished:
            self.following[conn] = lease
        counts.add("handed")

    def _unmapped(self, conn: socket.socket, lease: _Lease) -> None:
        """An asker closed its end (its mapping is gone, or its process): one holder less."""
        try:
            if conn.recv(64):
                return  # nothing is sent on it: ignore
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop(conn, lease)

    def _drop(self, conn: socket.socket, lease: _Lease) -> None:
        self.following.pop(conn, None)
        asyncio.get_running_loop().remove_reader(conn.fileno())
        conn.close()
        lease.release()

    def landing(self, lease: _Lease, size: int) -> None:
        """The read lands in `lease`'s memfd from now: answer who asked, and who asks."""
        self.lease, self.size = lease, size
        self._answer_waiting()

    def landed(self, i: int, off: int, n: int) -> None:
        """Bytes `off:off+n` of tensor `i` landed: tell who follows."""
        if self.finished or self.done:
            return
        record = _RANGE.pack(i, off, n)
        self.ranges.append(record)
        for conn, lease in list(self.following.items()):
            self._tell(conn, lease, record)

    def _tell(self, conn: socket.socket, lease: _Lease, record: bytes) -> None:
        try:
            sent = conn.send(record)
        except OSError:
            sent = 0
        if sent != len(record):
            self._drop(conn, lease)  # it stopped reading (a full buffer): it reads for itself

    def ready(self, lease: _Lease, size: int) -> None:
        """Every byte landed: tell who follows, answer who asked, and who asks for
        RDT_RELAY_KEEP_S while someone maps the memfd. `lease` is held for the claim
        until then (while it lands; or the memfd is a copy, which the first consumer does
        not map)."""
        self.lease, self.size, self.finished = lease, size, True
        following, self.following = self.following, {}
        for conn, held in following.items():
            self._tell(conn, held, DONE)
        self._answer_waiting()
        lease.release()  # the claim's: so it goes back, warm, once they let go (a later asker reads again)
        asyncio.get_running_loop().call_later(_keep_s(), self.close)

    def _answer_waiting(self) -> None:
        self._accept()  # who is still in the backlog asked too
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for conn in waiting:
            self._answer(conn)

    def end(self, lease: _Lease | None = None) -> None:
        """End the claim with nothing to give: who asked or followed reads for themselves
        (EOF); then `lease` (the claim's hold, while it landed) is let go."""
        for conn, held in list(self.following.items()):
            self._drop(conn, held)
        self.lease = None  # (who connected meanwhile gets EOF from `close`, not a memfd nobody will finish)
        self.close()
        if lease is not None:
            lease.release()

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        with counts.lock:
            counts.claims.discard(self)
        asyncio.get_running_loop().remove_reader(self.claim.fileno())
        self._accept()  # who connected last still gets the answer (or EOF)
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for conn in waiting:
            conn.close()
        self.claim.close()


_NO_CLAIM: Any = object()  # `_ask`'s answer where nobody of this node holds the object


def _cold_wait_s(size: int) -> float:
    return min(COLD_WAIT_MAX_S, max(COLD_WAIT_S, size / (1 << 30) * COLD_WAIT_PER_GIB_S))


async def _ask_within(
    obj_id: str, specs: Sequence[TensorSpec], wait_s: float, follow: list[torch.Tensor] | None, source: str = ""
) -> Any:
    """`_ask`, again for up to `wait_s` while nobody holds the object yet."""
    deadline = time.monotonic() + wait_s
    while True:
        got = await _ask(obj_id, specs, follow, source)
        if got is not _NO_CLAIM or time.monotonic() >= deadline:
            return got
        await asyncio.sleep(COLD_STEP_S)


def _ask_bound(nbytes: int) -> float:
    """How long an asker waits for the claimer's read before reading for itself: a
    claimer stuck alive (its process ended or failed: the asker hears at once) must not
    hold the node's other consumers for good. Generous: the read's own time at 25 MB/s."""
    return ASK_MIN_S + nbytes / 25e6


async def _ask(obj_id: str, specs: Sequence[TensorSpec], follow: list[torch.Tensor] | None = None, source: str = "") -> Any:
    """The object from the consumer of this node that holds it: None if it cannot give it,
    `_NO_CLAIM` if nobody holds it. Our end of the connection stays open while our
    mapping lives: its closing tells the holder that we no longer map the memfd.

    The holder answers at once where its read lands in the memfd, then tells of each range
    as it lands, and DONE. With `follow` (our caller's `into=` buffers, `_followable`), we
    copy each range there meanwhile and return `follow`; otherwise views of the memfd.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    fds: list[int] = []
    kept = False
    try:
        try:
            await loop.sock_connect(sock, _address(obj_id))
        except OSError:
            return _NO_CLAIM  # nobody claimed it, or the claim ended between our bind and connect
        if not _same_user(sock):
            return None  # the name is held by another user of this host: read for ourselves
        bound = _ask_bound(sum(s.nbytes for s in specs))
        deadline = time.monotonic() + bound
        if not await _readable(sock, bound):
            return _gave_up(obj_id, bound)
        try:
            msg, fds, flags = _receive(sock)
        except OSError:
            counts.add("unanswered")
            return None
        if not msg and not fds:
            counts.add("unanswered")
            return None  # its read failed, was cancelled, or its process died
        offsets, size = _layout(specs)
        answer, ranges = _framed(msg)
        why = _refusal(answer, fds, flags, obj_id, size)
        if why is not None:
            counts.add("refused")
            log.warning("rdt_async: the consumer of this node holding object %s answered %s; reading it myself", obj_id, why)
            return None
        try:
            views = _private(fds[0], specs, offsets, sock, source)
        except (OSError, ValueError) as exc:
            counts.add("refused")
            log.warning("rdt_async: could not map the memfd of object %s (%s); reading it myself", obj_id, exc)
            return None
        kept = True  # (the views close `sock` when they go)
        counts.add("mapped")
        try:
            done = await _follow(sock, ranges, specs, views, follow, deadline)
        except TimeoutError:
            return _gave_up(obj_id, bound)
        except _Untrue as exc:
            counts.add("refused")
            log.warning("rdt_async: the consumer of this node holding object %s answered %s; reading it myself", obj_id, str(exc))
            return None
        if not done:
            counts.add("unanswered")
            return None  # its read failed or was cancelled midway, or its process died
        return views if follow is None else follow
    finally:
        if not kept:
            sock.close()
        for fd in fds:
            os.close(fd)


def _gave_up(obj_id: str, bound: float) -> None:
    counts.add("gave_up")
    log.warning(
        "rdt_async: the consumer of this node reading object %s did not hand it over in %.3g s; reading it myself",
        obj_id, bound,
    )


async def _readable(sock: socket.socket, timeout: float) -> bool:
    """Wait until `sock` can be read (or its peer closed it); False after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(sock.fileno(), _io.set_once, readable)
    try:
        await asyncio.wait_for(readable, max(0.0, timeout))
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())


class _Untrue(Exception):
    """The holder told of a range that is not in the object."""


def _follows() -> bool:
    """Whether a consumer fetching `into=` copies each range as it lands (RDT_RELAY_FOLLOW:
    1, 0; by default where this process may run on FOLLOW_MIN_CORES cores or more).

    Copies that overlap the read pay where cores are free while the network delivers; on
    a machine with fewer, they take the cores the read needs: 8 consumers on 2 hosts of a
    2-core VM, each copying 256 MiB, took 15% longer following than after the read.
    """
    setting = os.environ.get("RDT_RELAY_FOLLOW", "")
    if setting in ("0", "1"):
        return setting == "1"
    return len(os.sched_getaffinity(0)) >= FOLLOW_MIN_CORES


def _followable(buffers: Sequence[torch.Tensor | None] | None, specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
    """`buffers` where each range can be copied into them as it lands (every one a
    contiguous CPU tensor of its spec's bytes), else None."""
    if buffers is None or len(buffers) != len(specs):
        return None
    ok = all(
        b is not None and b.device.type == "cpu" and b.is_contiguous() and b.numel() * b.element_size() == s.nbytes
        for b, s in zip(buffers, specs)
    )
    return [b for b in buffers if b is not None] if ok else None


async def _follow(
    sock: socket.socket,
    pending: bytes,
    specs: Sequence[TensorSpec],
    views: list[torch.Tensor],
    into: list[torch.Tensor] | None,
    deadline: float,
) -> bool:
    """Read the holder's ranges (`pending`: those that came with its answer) until DONE,
    copying each from `views` into `into` (where given) as it comes, and at DONE what none
    told of; True then, False if the holder closed first.

    Raises:
        TimeoutError: `deadline` passed first.
        _Untrue: a range outside the object, or anything after DONE.
    """
    copied: list[list[tuple[int, int]]] = [[] for _ in specs]
    while True:
        whole = len(pending) - len(pending) % _RANGE.size
        ranges, done = _ranges(pending[:whole], specs)
        pending = pending[whole:]
        if done and pending:
            raise _Untrue(f"with {len(pending)} bytes after DONE")
        if into is not None:
            for i, off, n in ranges:
                copied[i].append((off, off + n))
            if done:
                ranges += _untold(copied, specs)
            if ranges:
                await _io.to_thread_finished(_copy_ranges, views, into, ranges)
        if done:
            return True
        if not await _readable(sock, deadline - time.monotonic()):
            raise TimeoutError
        try:
            more = sock.recv(MAX_ANSWER)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            return False
        if not more:
            return False
        pending += more


def _ranges(data: bytes, specs: Sequence[TensorSpec]) -> tuple[list[tuple[int, int, int]], bool]:
    """The ranges `data` tells of (whole `_RANGE`s), checked against `specs`, and whether DONE ended them."""
    ranges: list[tuple[int, int, int]] = []
    for at in range(0, len(data), _RANGE.size):
        i, off, n = _RANGE.unpack_from(data, at)
        if i == _ALL:
            if at + _RANGE.size != len(data):
                raise _Untrue("with ranges after DONE")
            return ranges, True
        if not (i < len(specs) and 0 < n and off + n <= specs[i].nbytes):
            raise _Untrue(f"with a range ({i}, {off}, {n}) outside the object")
        ranges.append((i, off, n))
    return ranges, False


def _untold(copied: list[list[tuple[int, int]]], specs: Sequence[TensorSpec]) -> list[tuple[int, int, int]]:
    """The ranges of each tensor that no `copied` (start, end) span covers."""
    gaps = []
    for i, (spans, spec) in enumerate(zip(copied, specs)):
        at = 0
        for start, end in sorted(spans):
            if start > at:
                gaps.append((i, at, start - at))
            at = max(at, end)
        if at < spec.nbytes:
            gaps.append((i, at, spec.nbytes - at))
    return gaps


def _copy_ranges(views: list[torch.Tensor], into: list[torch.Tensor], ranges: list[tuple[int, int, int]]) -> None:
    """Copy each (tensor, byte offset, bytes) range of `views` into the same range of `into`."""
    for i, off, n in ranges:
        _bytes(into[i])[off : off + n].copy_(_bytes(views[i])[off : off + n])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _framed(msg: bytes) -> tuple[bytes, bytes]:
    """A claimer's first message: its answer (length-prefixed) and the ranges that follow it."""
    if len(msg) < _FRAME.size:
        return b"", b""
    (n,) = _FRAME.unpack_from(msg)
    end = _FRAME.size + n
    if end > len(msg):
        return msg[_FRAME.size :], b""  # cut short: no answer `_refusal` takes
    return msg[_FRAME.size : end], msg[end:]


def _receive(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One answer of the claimer: its bytes, every descriptor that came with them (the
    caller closes each, used or not), and recvmsg's flags (MSG_CTRUNC: the kernel dropped
    descriptors beyond the one expected).

    Raises:
        OSError: the connection failed.
    """
    fds = array.array("i")
    msg, ancdata, flags, _ = sock.recvmsg(MAX_ANSWER, socket.CMSG_SPACE(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


def _refusal(msg: bytes, fds: list[int], flags: int, obj_id: str, size: int) -> str | None:
    """What is wrong with a claimer's answer for `obj_id` (`size` bytes at the relay's
    layout, reckoned from our own specs), or None: it must be exactly the answer `_Server`
    sends, with one memfd that `_sealed_memfd` accepts."""
    if len(fds) != 1 or flags & socket.MSG_CTRUNC:
        return f"with {len(fds)}{'+' if flags & socket.MSG_CTRUNC else ''} descriptors, not one memfd"
    try:
        answer = json.loads(msg)
    except (ValueError, RecursionError):
        return f"with bytes that are not an answer ({msg[:64]!r})"
    if (
        type(answer) is not dict
        or answer.keys() != {"obj_id", "size"}
        or type(answer["obj_id"]) is not str
        or type(answer["size"]) is not int
    ):
        return f"with bytes that are not an answer ({msg[:64]!r})"
    if answer["obj_id"] != obj_id or answer["size"] != size:
        return f"for object {answer['obj_id'][:64]!r} of {answer['size']} bytes, not {obj_id!r} of {size}"
    return _sealed_memfd(fds[0], size)


def _sealed_memfd(fd: int, size: int) -> str | None:
    """What is wrong with `fd` as the memfd of an object of `size` bytes, or None: a
    readable memfd sealed against shrinking (nothing can cut it under our mapping: no
    SIGBUS), as large as the object and no larger than the pool makes one for it."""
    mode = fcntl.fcntl(fd, fcntl.F_GETFL)
    if mode & os.O_PATH or mode & os.O_ACCMODE == os.O_WRONLY:
        return "with a descriptor we cannot read"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # EINVAL: not a memfd (a pipe, a file on disk)
    except OSError:
        seals = 0
    st = os.fstat(fd)  # after the seals: a sealed size is final
    if not stat.S_ISREG(st.st_mode) or seals & SEALS != SEALS:
        return "with a descriptor that is not a sealed memfd"
    if not size <= st.st_size <= _Memfds.capacity(size):
        return f"with a memfd of {st.st_size} bytes, not {size} to {_Memfds.capacity(size)}"
    return None
