"""Versioned publishing: a producer publishes a state dict as version N; subscribers follow the newest.

A `Publisher` lives in an async `rdt.remote` actor (a trainer). It keeps up to `slots`
warm copies of the state dict in shared memory, each one storage that the user never
sees; `publish` copies the tensors into a free slot (off the loop), makes an RDT object
of the slot's tensors (as a producing method does: `auto`, no further copy, since the
slot is shared memory) and keeps that object as the newest version, dropping the one
before. A slot is free once the store holds none of its bytes: no ref to the version in
it is left anywhere and no consumer views it (shm views keep their object, see
transports/shm.py). So a version is never written while anyone can still read it, and
no subscriber ever sees a torn or mixed one. When every slot is busy, `when_full` says
what `publish` does: "wait" for a slot (bound it with `asyncio.timeout`) or "skip" the
version (it is not published; the trainer goes on).

A `Subscription` (`rdt.subscribe(actor, name)`) asks the producer's `rdt_publish`
concurrency group for a version newer than the one it holds (a long poll, answered at
once if there is one: the newest, so a slow subscriber skips what it missed), then
fetches it like any RDT object: views of the slot (shm) on the producer's node, one
transfer per node through the relay elsewhere, or straight into the caller's `into=`.
`Subscription.stream()` asks for the same version in chunks instead: RDT objects of the
slot's views grouped at tensor boundaries (`chunk_bytes` each, made on the first such
ask, shared by every streaming subscriber), fetched a few ahead and handed over tensor by
tensor as each chunk lands, so that loading overlaps the transfer.

Runs on: producer (Publisher, `serve_poll`) and consumer (Subscription).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import pickle
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ray
import torch

from . import _io, _metrics, _object, _produce, _ray, _relay, _tree
from ._buffers import share
from ._errors import ObjectFreedError, PeerDiedError, TransferError, few, translating
from ._local import aligned_layout, copy_to
from ._object import RDTObject
from ._store import store
from ._tree import Slot
from .transports import _segments

log = logging.getLogger(__name__)

POLL_S = 10.0  # a subscriber's wait is answered at least this often (it asks again)
ALIGN = 64
WHEN_FULL = ("wait", "skip")
CHUNK_BYTES = 32 << 20  # a streamed version's chunks: at least this much each (the last may be less)
MIN_CHUNK_BYTES = 1 << 20
FETCH_AHEAD = 2  # chunks a stream fetches beyond the one it hands over


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of the published state dict: its name and layout in a slot."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    copied: bool = True  # False: an earlier entry's tensor under another name (tied weights), at its offset


class _Slot:
    """One warm copy of the state dict: a shared-memory storage and a view per tensor."""

    def __init__(self, entries: list[_Entry], size: int) -> None:
        self.base = torch.empty(max(size, ALIGN), dtype=torch.uint8).share_memory_()
        self.offsets = [e.offset for e in entries]
        self.copied = [i for i, e in enumerate(entries) if e.copied]  # (a tied tensor is copied once)
        self.views = {e.name: _view(self.base, e) for e in entries}
        self.version: int | None = None

    def busy(self) -> bool:
        return store.held(self.base)


def _no_room(exc: RuntimeError) -> bool:
    """Whether torch's `share_memory_()` failed for want of room in /dev/shm."""
    return "No space left on device" in str(exc) or "Cannot allocate memory" in str(exc)


def _view(base: torch.Tensor, e: _Entry) -> torch.Tensor:
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)
    return base[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def _layout(state: Mapping[str, torch.Tensor]) -> tuple[list[_Entry], int]:
    """Each tensor's place in a slot; a tensor under two names (tied weights) has one, so
    that the version holds it under both names, as the state dict does."""
    tensors = list(state.values())
    first = _tree.firsts(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, size = aligned_layout([n if f == i else 0 for i, (n, f) in enumerate(zip(sizes, first))], ALIGN)
    entries = [
        _Entry(name, tuple(t.shape), t.dtype, offsets[f], n, f == i)
        for i, ((name, t), n, f) in enumerate(zip(state.items(), sizes, first))
    ]
    return entries, size


def _chunked(entries: list[_Entry], chunk_bytes: int) -> list[list[str]]:
    """The names of each chunk: consecutive tensors, cut once a chunk holds `chunk_bytes`."""
    groups: list[list[str]] = [[]]
    size = 0
    for e in entries:
        if size >= chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e.name)
        size += e.nbytes
    return groups


@dataclasses.dataclass(eq=False)
class _Version:
    """A published version: its object (the whole state dict), slot, and chunks once asked for."""

    number: int
    published_at: float
    obj: RDTObject
    views: dict[str, torch.Tensor]  # its tensors: a slot's views, or the caller's (lent)
    slot: _Slot | None  # None: lent (`publish(lend=True)`)
    chunks: list[RDTObject] | None = None
    handed: bool = False  # a poll's answer carried it (under the publisher's lock): others may read it
    making: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # (used on the polls' loop)
    # What the polls' answers carry, made at the first (`_wire`): of the object, and of its chunks.
    wire: _Wire | None = None
    chunk_wires: list[_Wire] | None = None


@dataclasses.dataclass(frozen=True)
class _Wire:
    """An object as the answer to a poll carries it: pickled once per version, its anchor
    beside the bytes (Ray counts each subscriber that gets it as a borrower, as of the
    object itself).

    Ray serializing the object into each answer cost the trainer ~20 us per tensor per
    subscriber, one answer after the other: of 8 subscribers of a 1000-tensor state dict,
    the last heard of a version 165-225 ms after `publish` returned (one node, quiet).
    """

    data: bytes
    anchor: Any


def _wire(obj: RDTObject) -> _Wire:
    return _Wire(pickle.dumps(dataclasses.replace(obj, anchor=None), protocol=pickle.HIGHEST_PROTOCOL), obj.anchor)


def _unwire(wire: Any, label: str) -> RDTObject:
    """The object a poll's answer carries (checked at its fetch, as any ref's fields are)."""
    if not isinstance(wire, _Wire):
        raise TransferError(f"{label}: the publisher answered with a {type(wire).__name__!r} object, not a version")
    try:
        obj = pickle.loads(wire.data)
    except Exception as exc:  # (bytes from another process)
        raise TransferError(f"{label}: the publisher's answer does not unpickle ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, RDTObject):
        raise TransferError(f"{label}: the publisher's answer holds a {type(obj).__name__!r} object, not a version")
    return dataclasses.replace(obj, anchor=wire.anchor)


def _copy(slot: _Slot, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the state dict into the slot (blocking: in the pool), split across the actor's
    cores where large, as shm's export copies (a slot is its twin: warm shared memory)."""
    with torch.no_grad():
        tensors = list(state.values())  # (in `_entries`' order, as `_check` saw)
        copy_to(slot.base.numpy(), [tensors[i] for i in slot.copied], [slot.offsets[i] for i in slot.copied])


_publishers: dict[str, Publisher] = {}  # this process's, by name
_closed: set[str] = set()  # names of this process's publishers closed (and not opened again)
_publishers_lock = threading.Lock()


class Publisher:
    """Publish versions of a state dict; subscribers on any node follow the newest.

    Create it in an async `rdt.remote` actor (its `__init__` or a method); subscribers
    reach it as `rdt.subscribe(actor, name)`. `slots` warm copies in shared memory are
    made as needed (at most `slots` times the state dict's bytes); `when_full` says what
    `publish` does when every slot is still read: "wait" until one is free (bound it with
    `asyncio.timeout`), or "skip" (the version is not published). `chunk_bytes`: what a
    streaming subscriber (`Subscription.stream`) fetches at a time, in whole tensors (at
    least 1 MiB). Close it (or use `async with`) to end every subscriber's `async for`.

    Runs on: producer.
    Raises: ValueError for a name already published in this process, a `slots` below 2,
    a `chunk_bytes` below 1 MiB or an unknown `when_full`; RuntimeError outside an async
    `rdt.remote` actor.
    """

    def __init__(
        self, name: str = "weights", /, *, slots: int = 3, when_full: str = "wait", chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"rdt.Publisher(name): a non-empty str, not {name!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
            raise ValueError(
                f"rdt.Publisher(slots={slots!r}): at least 2 (the newest version, and one to write the next into)"
            )
        if when_full not in WHEN_FULL:
            raise ValueError(
                f"rdt.Publisher(when_full={when_full!r}): 'wait' (publish waits for a free slot) "
                "or 'skip' (the version is not published)"
            )
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(
                f"rdt.Publisher(chunk_bytes={chunk_bytes!r}): at least {MIN_CHUNK_BYTES} (1 MiB); a streaming "
                "subscriber fetches that much at a time (default 32 MiB)"
            )
        _check_place()
        self.name, self.slots, self.when_full, self.chunk_bytes = name, slots, when_full, chunk_bytes
        self._slots: list[_Slot] = []
        self._entries: list[_Entry] | None = None
        self._groups: list[list[str]] = []  # the names of each chunk
        self._size = 0
        self._version = -1
        self._newest: _Version | None = None
        self._lock = threading.Lock()  # `_newest`, `_waiters`, `closed`: publish and the polls' loop
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._publishing: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one loop it publishes from
        self._closing: asyncio.Event | None = None  # set by close(): a publish waiting for a slot gives up
        # Which publisher numbered the versions: a subscription that followed another one
        # of this name (the actor restarted, or closed its publisher and made a new one)
        # takes this one's newest, whatever its number.
        self.incarnation = secrets.token_hex(8)
        self.closed = False
        self.dropped = 0
        self.lent = 0  # versions published with lend=True
        self.withdrawn = 0  # lent versions withdrawn by wait_unread while newest
        with _publishers_lock:
            if name in _publishers:
                raise ValueError(
                    f"this process publishes {name!r} already: close that Publisher first, or pick another name"
                )
            _publishers[name] = self
            _closed.discard(name)

    @property
    def version(self) -> int | None:
        """The newest version published (withdrawn or not), or None."""
        return None if self._version < 0 else self._version

    async def publish(self, state_dict: Mapping[str, torch.Tensor], /, *, lend: bool = False) -> int | None:
        """Publish a copy of `state_dict` as the next version; return its number (0, 1, ...).

        Returns once the copy is made (the caller may change its tensors then), never
        waiting for subscribers to read it. With every slot still read: waits for one
        (when_full="wait"), or returns None and publishes nothing (when_full="skip").

        `lend=True`: no copy and no slot; the version is `state_dict`'s own tensors, which
        must be in shared memory (`share_memory_()`). Subscribers read them as long as
        they read that version, so the caller writes them again only once
        `wait_unread(state_dict)` has returned (with two sets in turn, training into one
        while the other is read, that wait is ~0).
        Runs on: producer (an async actor's loop; the copy runs off it).
        Raises: TypeError for what is not a dict of CPU tensors by name (with `lend`, in
        shared memory); ValueError for a state dict whose names, shapes or dtypes differ
        from the first one published, or lent while its buffers are the newest version's
        (written while offered: call `wait_unread` first); RuntimeError once closed.
        """
        entries = self._check(state_dict)
        if lend:
            self._check_lendable(state_dict)
        loop = asyncio.get_running_loop()
        if self._publishing is None:
            self._publishing, self._loop, self._closing = asyncio.Lock(), loop, asyncio.Event()
        elif loop is not self._loop:
            raise RuntimeError(
                f"rdt.Publisher {self.name!r}.publish() from a second event loop: it publishes from the loop "
                "of its first publish (an actor's concurrency groups each run their own loop): publish from "
                "methods of one concurrency group"
            )
        async with self._publishing:
            if self.closed:
                raise RuntimeError(f"rdt.Publisher {self.name!r} is closed; make a new one to publish again")
            if lend:
                slot, views = None, dict(state_dict)
            else:
                slot = await self._free_slot(entries)
                if slot is None:
                    self.dropped += 1
                    return None
                await _io.to_thread_finished(_copy, slot, state_dict)  # a cancel waits for the copy to end
                views = dict(slot.views)
            obj = _object.snapshot_only(await _produce.produce_async(views, "auto"))
            with self._lock:
                if self.closed:  # closed while this version was copied: nobody may get it
                    del obj
                    raise RuntimeError(f"rdt.Publisher {self.name!r} was closed while this version was published")
                self._version += 1
                version = self._version
                if slot is None:
                    self.lent += 1
                else:
                    slot.version = version
                old, self._newest = self._newest, _Version(version, time.time(), obj, views, slot)
                waiters, self._waiters = self._waiters, []
            if old is not None and not old.handed:
                # No poll handed it out, so no other process has its ref: its slot is free
                # now, not once Ray reports its last ref gone (on a busy machine, after the
                # next publish looked: when_full="skip" skipped versions nobody read).
                store.free(old.obj.obj_id, last_ref=True)
            del old, obj  # the version before: its slot is free once nobody reads it
            _wake(waiters)
            return version

    def _check_lendable(self, state: Mapping[str, torch.Tensor]) -> None:
        for k, t in state.items():
            if not t.untyped_storage().is_shared():
                raise TypeError(
                    f"rdt.Publisher.publish(lend=True): {k!r} is not in shared memory; lend tensors that "
                    "share_memory_() put there once (model.share_memory()), or publish a copy (lend=False)"
                )
        newest = self._lending(state.values())
        if newest is not None:
            raise ValueError(
                f"rdt.Publisher {self.name!r}: publish(lend=True) of the buffers the newest version "
                f"({newest.number}) lends, which subscribers may be reading: write lent buffers only once "
                "`await publisher.wait_unread(them)` has returned"
            )

    async def wait_unread(self, state_dict: Mapping[str, torch.Tensor], /) -> None:
        """Return once no subscriber reads any tensor of `state_dict` (lent to a version,
        `publish(lend=True)`): the caller may write them then. Bound it with
        `asyncio.timeout`. Returns at once for tensors that no version holds.

        The newest version's buffers are withdrawn first: a subscriber that has not asked
        for that version yet gets the next one (as one too slow for it would), so the
        trainer waits only for the transfers and views under way.
        Runs on: producer (an async actor's loop).
        """
        tensors = list(state_dict.values())
        with self._lock:
            if self._lending(tensors) is not None:
                self._newest = None  # withdrawn: nobody gets it from now on
                self.withdrawn += 1
        _io.settle()  # views dropped just now: their frees have run
        for t in tensors:
            await store.wait_freed(t)

    def _lending(self, tensors: Iterable[torch.Tensor]) -> _Version | None:
        """The newest version, if it is lent from memory that `tensors` share."""
        newest = self._newest
        if newest is not None and newest.slot is None and share(tensors, newest.views.values()):
            return newest
        return None

    def _check(self, state: Any) -> list[_Entry]:
        if not isinstance(state, Mapping) or not state:
            raise TypeError(
                f"rdt.Publisher.publish() takes a non-empty dict of tensors by name (a state dict), "
                f"not {type(state).__name__}"
            )
        for k, t in state.items():
            if not isinstance(k, str) or not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"rdt.Publisher.publish(): entry {k!r} is {type(t).__name__} under a "
                    f"{type(k).__name__} key; give str names and tensors (model.state_dict())"
                )
            if t.device.type != "cpu" or t.layout != torch.strided:
                raise TypeError(
                    f"rdt.Publisher.publish(): {k!r} is a {t.device.type} {t.layout} tensor; this version "
                    "publishes dense CPU tensors (move them with .cpu() first)"
                )
            why = _produce.unmovable(t)
            if why is not None:
                raise TypeError(f"rdt.Publisher.publish(): {k!r} is {why}")
        entries, size = _layout(state)
        if self._entries is None:
            self._entries, self._size = entries, size
            self._groups = _chunked(entries, self.chunk_bytes)
        elif entries != self._entries:
            raise ValueError(f"rdt.Publisher {self.name!r}: {_difference(self._entries, entries)}; "
                             "a publisher's versions keep the first one's names, shapes and dtypes "
                             "(publish a different layout under another name)")
        return entries

    async def _free_slot(self, entries: list[_Entry]) -> _Slot | None:
        """A slot nobody reads (made if fewer than `slots` exist), or None to skip."""
        looked_again = made_room = False
        while True:
            if self.closed:
                raise RuntimeError(f"rdt.Publisher {self.name!r} was closed while this version waited for a slot")
            _io.settle()  # views dropped just now: their frees have run
            newest = self._newest
            for slot in self._slots:
                if (newest is None or slot.version != newest.number) and not slot.busy():
                    return slot
            if len(self._slots) < self.slots:
                try:
                    slot = await _io.to_thread(_Slot, entries, self._size)  # fresh shared memory: off the loop
                except RuntimeError as exc:
                    if not _no_room(exc):
                        raise
                    if not made_room:  # this process's idle warm segments may hold the room: once, let them go
                        made_room = True
                        if await _io.to_thread(_segments.pool.make_room) is not None:
                            continue
                    self._cap_slots(exc)  # (raises where fewer than two could be made)
                    continue
                self._slots.append(slot)
                return slot
            if self.when_full == "skip":
                if looked_again:
                    return None
                # The versions this publisher let go of just now are freed on the I/O loop
                # (their last ref's word, `_object._on_anchor_gone`): after a turn of it,
                # look once more (two slots, published back to back, skipped every other).
                looked_again = True
                await _io.start(_turn())
                continue
            # Wait for any slot but the newest's to be let go, or for `close()`.
            waits: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(store.wait_freed(s.base))
                for s in self._slots
                if newest is None or s.version != newest.number
            ]
            assert self._closing is not None  # (made with the publishing loop)
            waits.append(asyncio.ensure_future(self._closing.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def _cap_slots(self, exc: RuntimeError) -> None:
        """/dev/shm had no room for one more slot, even with this process's idle warm
        segments let go of: publish with the slots there are from now on (two at least: the
        newest version, and one to write the next into), said once; else raise."""
        said = (
            f"{_segments.SHM_DIR} has no room for slot {len(self._slots) + 1} of rdt.Publisher {self.name!r} "
            f"({self._size / (1 << 20):.1f} MiB; {_segments.room()})"
        )
        if len(self._slots) < 2:
            raise RuntimeError(
                f"{said}: a publisher keeps at least 2 copies of the state dict there; {_segments.MORE_ROOM}"
            ) from exc
        log.warning("rdt_async: %s: publishing with %d slots instead of %d; %s", said, len(self._slots), self.slots, _segments.MORE_ROOM)
        self.slots = len(self._slots)

    def close(self) -> None:
        """Stop publishing: subscribers' `async for` ends; slots go once nobody reads them."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._newest = None
            waiters, self._waiters = self._waiters, []
        if self._loop is not None and self._closing is not None:  # a publish() waiting for a slot gives up
            try:
                self._loop.call_soon_threadsafe(self._closing.set)  # (close() may come from another thread)
            except RuntimeError:  # that loop is closed: nobody waits there
                pass
        with _publishers_lock:
            if _publishers.get(self.name) is self:
                del _publishers[self.name]
                _closed.add(self.name)
        self._slots = []  # each slot's memory goes with the last view of it
        _wake(waiters)

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """This publisher's state: newest version, slots made and busy, versions skipped."""
        _io.settle()
        return {
            "name": self.name,
            "version": self.version,
            "slots": len(self._slots),
            "slots_busy": sum(s.busy() for s in self._slots),
            "slot_bytes": self._size,
            "skipped": self.dropped,
            "lent": self.lent,  # versions published from the caller's own buffers
            "withdrawn": self.withdrawn,  # of those, taken back while newest (wait_unread)
            "waiting": len(self._waiters),  # subscribers waiting for the next version
            "when_full": self.when_full,
            "chunks": len(self._groups),  # what a streaming subscriber fetches a version in
        }

    def __repr__(self) -> str:
        return f"rdt.Publisher({self.name!r}, version={self.version}, slots={len(self._slots)}/{self.slots})"


def _check_place() -> None:
    """Refuse a publisher that no subscriber could reach: outside an async `rdt.remote` actor.

    Raises: RuntimeError naming the fix.
    """
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:
        raise RuntimeError(
            "rdt.Publisher lives in an async @rdt.remote actor (subscribers reach it through "
            "that actor's handle), not in the driver or a task: create it in the actor's __init__"
        )
    if not hasattr(ctx.current_actor, "rdt__publication"):
        raise RuntimeError(
            "rdt.Publisher lives in an async @rdt.remote actor: this actor is not one (its class "
            "needs @rdt.remote and at least one `async def` method)"
        )


def _difference(old: list[_Entry], new: list[_Entry]) -> str:
    o, n = {e.name: e for e in old}, {e.name: e for e in new}
    if o.keys() != n.keys():
        missing, extra = [repr(k) for k in sorted(o.keys() - n.keys())], [repr(k) for k in sorted(n.keys() - o.keys())]
        return f"names differ from the first version's (missing [{few(missing)}], new [{few(extra)}])"
    for name, e in n.items():
        if (e.shape, e.dtype) != (o[name].shape, o[name].dtype):
            return f"{name!r} is {e.dtype} {list(e.shape)}, was {o[name].dtype} {list(o[name].shape)}"
        if e.copied != o[name].copied:
            was, now = ("tied to another name", "its own tensor") if e.copied else ("its own tensor", "tied to another name")
            return f"{name!r} is {now}, was {was} (tied weights)"
    return "the names come in another order than the first version's"


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
    for loop, fut in waiters:
        try:
            loop.call_soon_threadsafe(_io.set_once, fut)
        except RuntimeError:  # its loop is closed
            pass



async def serve_poll(
    name: str, after: int, wait_s: float, chunked: bool = False, incarnation: str | None = None
) -> tuple[Any, ...]:
    """Answer a subscriber: ("ok", version, published_at, what, waited, incarnation) for the
    newest version after `after`, once there is one (`what`: its object, or with `chunked`
    the list of its chunks' objects; `waited`: none was there when it asked; at most
    `wait_s` later: ("none",)); ("closed",) or ("missing", names) if there is nothing to
    follow. `after` counts only where `incarnation` is this publisher's (a subscriber of
    an earlier publisher of this name takes this one's newest).

    Runs on: producer (the `rdt_publish` concurrency group's loop).
    """
    with _publishers_lock:
        pub = _publishers.get(name)
        if pub is None:
            return ("closed",) if name in _closed else ("missing", sorted(_publishers))
    if incarnation != pub.incarnation:
        after = -1
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    waited = False
    with pub._lock:
        if pub.closed:
            return ("closed",)
        newest = pub._newest
        behind = newest is None or newest.number <= after
        if behind:
            pub._waiters.append((loop, fut))
        elif newest is not None:
            newest.handed = True
    if behind:
        # Not held while this poll waits (up to wait_s): the version it already has would
        # stay held here, its lent buffers unwritable (`wait_unread`) or its slot busy.
        newest = None
        waited = True
        try:
            await asyncio.wait_for(fut, wait_s)
        except TimeoutError:
            pass
        finally:
            with pub._lock:
                if (loop, fut) in pub._waiters:
                    pub._waiters.remove((loop, fut))
        with pub._lock:
            if pub.closed:
                return ("closed",)
            newest = pub._newest
            if newest is not None and newest.number > after:
                newest.handed = True
    if newest is None or newest.number <= after:
        return ("none",)
    if chunked:
        chunks = await _chunks(pub, newest)
        if newest.chunk_wires is None:
            newest.chunk_wires = [_wire(c) for c in chunks]
        what: Any = newest.chunk_wires
    else:
        if newest.wire is None:
            newest.wire = _wire(newest.obj)
        what = newest.wire
    return ("ok", newest.number, newest.published_at, what, waited, pub.incarnation)


async def _chunks(pub: Publisher, version: _Version) -> list[RDTObject]:
    """The objects of `version`'s chunks, made on the first ask (the version, held here,
    keeps its slot meanwhile: the chunks are views of it, so of that version only).

    Runs on: producer (the polls' loop).
    """
    if len(pub._groups) <= 1:
        return [version.obj]  # one chunk: the version's own object
    async with version.making:
        if version.chunks is None:
            views = version.views
            version.chunks = [
                _object.snapshot_only(await _produce.produce_async({n: views[n] for n in names}, "auto"))
                for names in pub._groups
            ]
    return version.chunks


_subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
_ids = itertools.count()


class Subscription:
    """Follow a publisher's newest version: ``async for version, weights in rdt.subscribe(actor, name)``.

    Each step waits for a version newer than the one it gave last and returns the newest
    (versions published meanwhile are skipped), whole: never a mix of two. `await
    next(into=...)` lands it in the caller's own tensors (a dict by name, such as
    `model.state_dict()`, or a list in the published order); where that breaks off part
    way (a cancel, a deadline, a failure), those tensors hold a mix and `version` is None
    until the next step has landed the newest version whole. Without `into=`, on the
    producer's node the tensors are views of the producer's slot: keeping them keeps that
    slot busy (in the publishing process itself: a copy). Bound any wait with
    `asyncio.timeout`. While it lives, its node keeps memory warm for the next version
    (see the publishing docs): `close()` (or `async with rdt.subscribe(...) as sub:`) lets
    go of that now rather than when it is collected.

    Runs on: consumer (any process with an event loop).
    """

    def __init__(self, actor: Any, name: str = "weights", /) -> None:
        if not isinstance(actor, ray.actor.ActorHandle):
            raise TypeError(
                f"rdt.subscribe() takes the publishing actor's handle, not {type(actor).__name__}: "
                "rdt.subscribe(trainer, 'weights')"
            )
        if not hasattr(actor, "rdt__publication"):
            raise TypeError(
                "rdt.subscribe(): that actor cannot publish; a Publisher lives in an async "
                "@rdt.remote actor (one with an `async def` method)"
            )
        if not isinstance(name, str) or not name:
            raise TypeError(f"rdt.subscribe(actor, name): a non-empty str, not {name!r}")
        self.actor, self.name = actor, name
        # The version last taken whole; None before the first, and after a fetch `into=` that
        # broke off part way (a cancel, a timeout, a failure): those tensors then hold a mix,
        # and the next step takes the newest version, whatever its number, to make them whole.
        self.version: int | None = None
        self._incarnation: str | None = None  # the publisher that numbered `version`
        self.lag: int | None = None  # versions it was behind the newest when it last asked (0: it waited)
        self.skipped = 0
        self.received = 0
        self.closed = False  # the publisher closed: `async for` ends
        self.apply_s: float | None = None  # the last version's fetch, from its answer to its tensors in hand
        self.delay_s: float | None = None  # from its publish to its tensors in hand
        self._id = next(_ids)
        self._warm: tuple[str, int, frozenset[int], Callable[[], None]] | None = None  # whose relay memory we keep warm: how many, of which sizes
        self._ended = False  # `close()` was called
        _subscriptions.add(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop following the publisher: let go of the memory this node keeps warm for its
        versions now. What it returned stays usable; `next()` and `stream()` raise after
        it. A second call does nothing."""
        self._ended = True
        self._let_go_warm()

    async def __anext__(self) -> tuple[int, dict[str, torch.Tensor]]:
        if self._ended:
            raise StopAsyncIteration  # (closed: `async for` ends)
        try:
            return await self.next()
        except ObjectFreedError:
            if self.closed:
                raise StopAsyncIteration from None
            raise

    async def next(self, *, into: Any = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait for a version newer than the last one returned; return `(version, weights)`.

        Raises: ObjectFreedError once the publisher is closed; PeerDiedError if its actor
        died (what was returned before stays usable); LookupError if the actor publishes
        nothing under this name; what `rdt.fetch` raises.
        """
        # Waiting for the next version and about to fetch it: the node's other subscribers
        # wait for this process's claim where it keeps the memory the version lands in.
        expected = _relay.memfds.expect(self._warm[0]) if self._warm is not None else None
        writing = False  # whether `into=` may hold part of this version
        try:
            version, published_at, obj, waited, incarnation = await self._poll(chunked=False)
            started = time.perf_counter()
            writing = into is not None
            weights = await _fetch(obj, into)
        except BaseException as exc:
            if isinstance(exc, PeerDiedError):
                self._let_go_warm()  # its objects are gone with it: no memory kept for them
            if writing and not isinstance(exc, (ValueError, TypeError)):  # (those: refused before anything moved)
                self.version = None  # `into=` holds a mix now
            raise
        finally:
            if expected is not None:
                expected()
        del obj  # views of the slot keep its object: nothing else here holds the version
        self._took(version, incarnation, published_at, waited, started)
        return version, weights

    def stream(self, *, into: Any = None) -> VersionStream:
        """The next newer version's tensors as they land: ``async for name, tensor in sub.stream()``.

        Waits (at the first step) for a version newer than the last one taken, as `next`
        does, then yields `(name, tensor)` in the published order, each whole and all of
        that one version, while the tensors after it still arrive: use tensor k while
        k + 1 loads. `.version` says which version (once the first step returned).
        `into=` as for `next` (its tensors receive the version and are the ones yielded).
        The version counts as taken (`.version`, stats) once its last tensor landed;
        breaking out, a cancel or `aclose()` (or `async with sub.stream() as s`) before
        that stops its fetches and lets go of what it held.

        Raises (from the iteration): what `next` raises; ValueError for an `into=` that
        does not match the published tensors.
        """
        return VersionStream(self, into)

    async def _poll(self, *, chunked: bool) -> tuple[int, float, Any, bool, str]:
        """Wait for a version newer than the last taken (of any number, from another
        publisher of this name): (version, published_at, object or chunks, waited, incarnation)."""
        if self._ended:
            raise RuntimeError(f"rdt.subscribe(actor, {self.name!r}): this subscription was closed; subscribe again")
        after = -1 if self.version is None else self.version
        label = f"waiting for a version of {self.name!r} newer than {after}"
        while True:
            ref: Any = self.actor.rdt__publication.remote(self.name, after, POLL_S, chunked, self._incarnation)
            try:
                with translating(label):
                    reply = await _ray.await_ref(ref)
            except asyncio.CancelledError:
                _cancel(ref)  # the producer's wait ends now, not POLL_S later
                raise
            except PeerDiedError:
                self._let_go_warm()  # its objects are gone with it: no memory kept for them
                raise
            finally:
                del ref
            kind = reply[0]
            if kind == "ok":
                break
            if kind == "closed":
                self.closed = True
                self._let_go_warm()
                raise ObjectFreedError(f"{label}: the publisher closed")
            if kind == "missing":
                raise LookupError(
                    f"rdt.subscribe(actor, {self.name!r}): that actor publishes "
                    f"{reply[1] if reply[1] else 'nothing'}; make `rdt.Publisher({self.name!r})` there first"
                )
        _, version, published_at, what, waited, incarnation = reply if len(reply) == 6 else (*reply, None)
        del reply
        newer = after if incarnation == self._incarnation else -1  # (another publisher: any number)
        if (type(version) is not int or version <= newer or type(published_at) is not float
                or type(waited) is not bool or type(incarnation) is not str or len(incarnation) > 64):
            raise TransferError(  # (an answer from another process: no version that is not newer, nor a count gone negative)
                f"{label}: the publisher answered version {version!r} (published at {published_at!r}), "
                "not a newer one; is that actor's rdt_async the same version as this one's?"
            )
        if not chunked:
            obj = _unwire(what, label)
            self._keep_warm([obj], 1)
            return version, published_at, obj, waited, incarnation
        if type(what) is not list or not what:
            got = "an empty list" if type(what) is list else f"a {type(what).__name__!r} object"
            raise TransferError(f"{label}: the publisher answered with {got}, not a list of chunks")
        objs = [_unwire(w, label) for w in what]
        self._keep_warm(objs, 1 + FETCH_AHEAD)  # (the chunks it fetches at once)
        return version, published_at, objs, waited, incarnation

    def _keep_warm(self, objs: Sequence[RDTObject], each: int) -> None:
        """Keep the node relay's memory for the publisher's versions (`objs`: one, or a
        version's chunks) warm while this subscription lives (`_relay._Memfds.want`: `each`
        memfds of each of their sizes): the next version lands in memory that the last one
        faulted in, however long a step takes."""
        source = _relay.source_of(objs[0].producer.node_id, objs[0].producer.pid)
        sizes = frozenset(_relay.size_of(o.specs) for o in objs)
        warm = self._warm
        if warm is not None and warm[0] == source and warm[1] >= each and sizes <= warm[2]:
            return
        release = _relay.memfds.want(source, each, sorted(sizes))
        old, self._warm = self._warm, (source, each, sizes, release)
        _io.finalize(self, release)
        if old is not None:  # (the publisher's actor restarted, a new process; a stream asks for more; new sizes)
            old[3]()  # (after the new one is wanted: its memory is never unwanted meanwhile)

    def _let_go_warm(self) -> None:
        if self._warm is not None:
            self._warm[3]()
            self._warm = None

    def _took(self, version: int, incarnation: str, published_at: float, waited: bool, started: float) -> None:
        """Count `version` (numbered by publisher `incarnation`) as taken: its tensors are in hand."""
        self.apply_s = time.perf_counter() - started
        self.delay_s = max(0.0, time.time() - published_at)
        self.received += 1
        last = self.version if incarnation == self._incarnation else None  # (another publisher: counts anew)
        if last is not None and version <= last:
            return  # another step of this subscription took a newer one meanwhile: `version` stays
        skipped = 0 if last is None else version - last - 1
        # Behind by how many versions when it asked: 0 if it waited for this one.
        self.lag = 0 if waited or last is None else version - last
        self.skipped += skipped
        self.version, self._incarnation = version, incarnation
        _metrics.subscribed(_class_label(self.actor), self.name, version, self.lag, skipped, self.apply_s)

    def stats(self) -> dict[str, Any]:
        """This subscription: current version, versions skipped, lag, apply time."""
        return {
            "name": self.name,
            "producer": _actor_label(self.actor),
            "version": self.version,
            "received": self.received,
            "skipped": self.skipped,
            "lag": self.lag,
            "apply_s": self.apply_s,
            "delay_s": self.delay_s,
        }

    def __repr__(self) -> str:
        return f"rdt.Subscription({self.name!r}, version={self.version})"


class VersionStream:
    """The tensors of one version as they land (`Subscription.stream`): an async iterator
    of `(name, tensor)`.

    `version`: the version streamed (None before the first step); `chunks`: how many
    objects it comes in; `landed`: how many of them are in hand so far.

    Runs on: consumer.
    """

    def __init__(self, sub: Subscription, into: Any) -> None:
        self._sub, self._into = sub, into
        self.version: int | None = None
        self.chunks = 0
        self._objs: list[RDTObject | None] = []
        self._names: list[list[str]] = []
        self._targets: list[list[torch.Tensor] | None] = []
        self._tasks: list[asyncio.Future[Any] | None] = []
        self._ready: collections.deque[tuple[str, torch.Tensor]] = collections.deque()
        self._next = 0  # the chunk to hand over next
        self._taken: tuple[str, float, bool, float] | None = None  # incarnation, published_at, waited, started
        self._started = self._ended = False

    @property
    def landed(self) -> int:
        """How many chunks are in hand (handed over, or fetched and waiting)."""
        return self._next + sum(1 for t in self._tasks[self._next :] if t is not None and t.done())

    def __aiter__(self) -> VersionStream:
        return self

    async def __aenter__(self) -> VersionStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if self._ended:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                await self._begin()
            while not self._ready:
                if self._next == self.chunks:
                    self._drop()
                    raise StopAsyncIteration
                await self._land()
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise
        return self._ready.popleft()

    async def _begin(self) -> None:
        sub = self._sub
        version, published_at, objs, waited, incarnation = await sub._poll(chunked=True)
        started = time.perf_counter()
        names = [_names_of(o) for o in objs]  # (`_poll` checked they are a list of versions' chunks)
        targets: list[list[torch.Tensor] | None] = [None] * len(objs)
        if self._into is not None:
            flat = [n for ns in names for n in ns]
            into = _ordered(self._into, flat, "stream", objs) if isinstance(self._into, Mapping) else self._into
            tensors = _tree.flatten(into)[1]
            if len(tensors) != len(flat):
                raise ValueError(
                    f"Subscription.stream(into=...): {len(tensors)} tensors for the {len(flat)} published; "
                    "give a dict by name (model.state_dict()) or a list of them in the published order"
                )
            at = 0
            for i, ns in enumerate(names):
                targets[i] = tensors[at : at + len(ns)]
                at += len(ns)
        self.version, self.chunks = version, len(objs)
        self._objs, self._names, self._targets = list(objs), names, targets
        self._tasks = [None] * len(objs)
        self._taken = (incarnation, published_at, waited, started)

    async def _land(self) -> None:
        """Fetch ahead, then wait for the next chunk and queue its tensors."""
        from ._api import fetch

        i = self._next
        if i == 0 and self._into is not None and self._tasks and self._tasks[0] is None:
            # From the first write on, `into=` holds no whole version until the last chunk
            # lands (`_took`), however the stream ends: broken out of with the stream kept
            # in a name, nothing else would say so before it is collected.
            self._sub.version = None
        for j in range(i, min(i + 1 + FETCH_AHEAD, self.chunks)):
            if self._tasks[j] is None:
                started = asyncio.ensure_future(fetch(self._objs[j], into=self._targets[j]))
                started.add_done_callback(_retrieved)
                self._tasks[j] = started
        task = self._tasks[i]
        assert task is not None  # (started above)
        try:
            value = await task
        except PeerDiedError:
            self._sub._let_go_warm()  # its objects are gone with it: no memory kept for them
            raise
        del task
        if self._targets[i] is None:
            value = _own(self._objs[i], value)
        self._tasks[i] = self._objs[i] = self._targets[i] = None  # (views keep their object themselves)
        self._next += 1
        self._ready.extend((n, value[n]) for n in self._names[i])
        del value
        if self._next == self.chunks and self._taken is not None and self.version is not None:
            self._sub._took(self.version, *self._taken)
            self._taken = None

    async def aclose(self) -> None:
        """Stop: cancel the fetches in flight, let go of every chunk not handed over."""
        tasks = [t for t in self._tasks if t is not None]
        self._drop()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drop(self) -> None:
        self._ended = True
        self._taken = None  # (stopped before its last tensor landed, `into=` says no version: `_land`)
        for t in self._tasks:
            if t is not None:
                t.cancel()
        self._tasks, self._objs, self._targets = [], [], []
        self._ready.clear()

    def __del__(self) -> None:
        # Broken out of without aclose: the fetches in flight stop (their cancel releases).
        for t in self._tasks:
            if t is not None and not t.done():
                try:
                    t.cancel()
                except RuntimeError:  # its loop closed
                    pass

    def __repr__(self) -> str:
        return f"rdt.VersionStream({self._sub.name!r}, version={self.version}, landed={self.landed}/{self.chunks})"


async def _turn() -> None:
    """Nothing, on the I/O loop: awaited, a turn of it (what it was told before has run)."""


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # said where it is awaited, or not at all once the stream stopped


async def _fetch(obj: RDTObject, into: Any) -> dict[str, torch.Tensor]:
    from ._api import fetch

    if isinstance(into, Mapping):
        into = _ordered(into, _names_of(obj), "next", [obj])
    value: dict[str, torch.Tensor] = await fetch(obj, into=into)
    return value if into is not None else _own(obj, value)


def _own(obj: RDTObject | None, value: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`value`, fetched without `into=`; a copy where this process published it: its tensors
    are then the slot's (or the lent buffers) themselves, which a later publish writes and
    nothing here would keep from doing so. A tensor under two names stays one."""
    if obj is None or not _object.is_local(obj):
        return value
    copies: dict[int, torch.Tensor] = {}
    for t in value.values():
        if id(t) not in copies:
            copies[id(t)] = t.clone()
    return {n: copies[id(t)] for n, t in value.items()}


def _names_of(obj: RDTObject) -> list[str]:
    """The published names, in the order of their tensors (the value is a flat dict of them).

    Raises: TransferError for a skeleton that is not one (it came from another process).
    """
    skeleton = obj.skeleton
    if type(skeleton) is not dict or not all(type(k) is str and isinstance(v, Slot) for k, v in skeleton.items()):
        raise TransferError(f"version object {obj.obj_id} is not a published state dict")
    # As a producer makes it: tensors numbered in the names' order, a tied one's second name
    # (tied weights) naming an earlier one. (`into=` buffers go to the names in this order.)
    seen = 0
    for v in skeleton.values():
        if v.index == seen:
            seen += 1
        elif not (type(v.index) is int and 0 <= v.index < seen):
            raise TransferError(f"version object {obj.obj_id} is not a published state dict (its tensors are out of order)")
    return list(skeleton)


def _ordered(into: Mapping[str, Any], names: list[str], verb: str, objs: list[RDTObject]) -> list[Any]:
    """`into`'s tensors in the order of `names` (those of `objs`, the version or its chunks),
    each of its published shape and dtype.

    Raises: ValueError naming the names that differ, or the tensor that does (`fetch`
    would name its place only).
    """
    missing = [n for n in names if n not in into]
    published = set(names)
    extra = [k for k in into if k not in published]
    if missing or extra:
        raise ValueError(
            f"Subscription.{verb}(into=...): the dict's names differ from the published ones "
            f"(missing [{few([repr(k) for k in missing])}], not published [{few([repr(k) for k in extra])}]); "
            "give a dict with exactly the published names"
        )
    out = [into[n] for n in names]
    specs = {n: o.specs[v.index] for o in objs for n, v in o.skeleton.items() if v.index < len(o.specs)}
    for n, t in zip(names, out):
        spec = specs.get(n)
        if spec is not None and isinstance(t, torch.Tensor) and (t.shape != spec.shape or t.dtype != spec.dtype):
            raise ValueError(
                f"Subscription.{verb}(into=...): {n!r} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                f"the published {n!r} is {str(spec.dtype).removeprefix('torch.')}{list(spec.shape)}; give tensors "
                "of the published shapes and dtypes (for a model of another dtype: receive into tensors of the "
                "published one, then copy)"
            )
    return out


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # (done already, or Ray shutting down): its wait ends within POLL_S anyway
        pass


def _actor_label(actor: Any) -> str:
    try:
        return f"actor {actor._ray_actor_id.hex()[:8]}"
    except AttributeError:
        return "actor"


def _class_label(actor: Any) -> str:
    """The actor's class name: what tells publishers apart in the metrics, bounded by the code
    (an actor's id would add series for every actor ever subscribed to)."""
    try:
        return str(actor._ray_actor_creation_function_descriptor.class_name)
    except AttributeError:
        return "actor"


def subscribe(actor: Any, name: str = "weights", /) -> Subscription:
    """Follow the versions `actor` publishes under `name`: ``async for version, weights in ...``.

    Runs on: consumer. Nothing is asked of the actor until the first wait.
    Raises: TypeError for what is not an actor handle, or an actor that cannot publish.
    """
    return Subscription(actor, name)


def stats() -> dict[str, Any]:
    """This process's publications and subscriptions, for `store_stats()`."""
    with _publishers_lock:
        pubs = list(_publishers.values())
    subs = sorted(_subscriptions, key=lambda s: s._id)
    return {"publications": [p.stats() for p in pubs], "subscriptions": [s.stats() for s in subs]}
