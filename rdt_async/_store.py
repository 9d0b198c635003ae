"""The process-local store: tensors kept by their producer until every ref is gone.

It also answers `wait_tensor_freed`: a tensor is *held* from the moment a producing
call starts making an object of it (before any export), while the object is stored, and
while a send or a collective reads it; and a tensor is held when any held tensor shares
bytes with it (a view, a slice, the same storage under another tensor object).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _caller, _io, _metrics

if TYPE_CHECKING:
    from .transports._base import Transport

log = logging.getLogger("rdt_async")


# The bytes a tensor covers: a place in memory and an absolute byte range there. Memory is
# named twice: by its address, per device and per 4 MiB of addresses it touches (two storages
# over the same memory that start at different addresses: `torch.from_numpy` of two slices of
# one array, `frombuffer(offset=)`, DLPack), and by the storage itself, with the range in it
# (its memory may move: `share_memory_()` moves a storage into shared memory).
_Span = tuple[tuple[str, int], int, int]
_CHUNK = 22  # log2 of the address range a hold is filed under: a 1 GiB tensor is 257 spans


def extent(t: torch.Tensor) -> tuple[torch.UntypedStorage, int, int] | None:
    """The storage `t` views and the byte range in it that `t` reaches, or None where `t`
    has no bytes (no elements, no storage: meta, sparse)."""
    if t.numel() == 0 or t.is_meta or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.is_contiguous():  # (a state dict's tensors: 200 of them per object, on every return)
        return storage, start, start + t.numel() * size
    # the furthest element a strided view reaches: a safe (over-)estimate of its bytes
    return storage, start, start + (sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1) * size


def _spans(tensors: Sequence[torch.Tensor]) -> list[_Span]:
    out: list[_Span] = []
    for t in tensors:
        found = extent(t)
        if found is None:
            continue  # nothing to hold (and refused at return anyway)
        storage, start, end = found
        device = "cpu" if t.is_cpu else str(t.device)
        base = storage.data_ptr()
        first, last = base + start, base + end
        out.extend(((device, chunk), first, last) for chunk in range(first >> _CHUNK, ((last - 1) >> _CHUNK) + 1))
        out.append((("storage", int(storage._cdata)), start, end))
    return out


def _lends(transport: Transport[Any], meta: Any) -> bool:
    try:
        return transport.lends_memory(meta)
    except Exception:  # a transport's hook failing: hold, as the safe side
        log.exception("rdt_async: %s.lends_memory failed", transport.name)
        return True


@dataclass
class StoredObject:
    """What a producer keeps for one object."""

    tensors: list[torch.Tensor]
    # transport -> the metadata it prepared for this object (registrations, segments).
    prepared: dict[Transport[Any], Any] = field(default_factory=dict)
    spans: list[_Span] | None = None  # the bytes it holds (computed once)
    # Sent to another process from these very tensors (two-sided transports), fetched
    # here (the tensors themselves): both together is the case to warn about, once.
    served: bool = False
    fetched_here: bool = False
    warned: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def both_ways(self, *, served: bool) -> bool:
        """Note a send of these tensors to another process (`served`), or a fetch of them
        here; say whether the producer is to be warned now (`shared_with_producer`): both
        have happened, and it was not warned yet."""
        if served:
            self.served = True
        else:
            self.fetched_here = True
        if not (self.served and self.fetched_here) or self.warned:
            return False
        self.warned = True
        return True


class Store:
    """Objects this process produced, keyed by object id, and who holds which bytes. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, StoredObject] = {}
        self._bytes = 0  # theirs, in all
        # place (`_Span`'s) -> hold key -> byte ranges that hold keeps. A hold key is an object id,
        # or an int for a hold without one (an object being made, a read in progress).
        self._held: dict[tuple[str, int], dict[str | int, list[tuple[int, int]]]] = {}
        # Holds of objects being made whose bytes nobody has asked about yet (`holding`):
        # their ranges are worked out once a waiter looks (`_overlaps`), then held as any.
        self._unseen: dict[int, Sequence[torch.Tensor]] = {}
        self._seen: dict[int, list[_Span]] = {}
        # Objects held since `add` whose bytes nobody has asked about yet: likewise.
        self._unseen_objects: dict[str, StoredObject] = {}
        self._waiters: list[tuple[list[_Span], Callable[[], object]]] = []
        self._keys = itertools.count()
        self._freed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Objects freed explicitly whose consumers may still view the producer's memory
        # (Transport.lends_memory): their holds, kept until their last ref goes.
        self._lent: dict[str, list[_Span]] = {}

    # -- holds -------------------------------------------------------------------------

    def _hold(self, key: str | int, spans: list[_Span]) -> None:
        for storage, start, end in spans:
            self._held.setdefault(storage, {}).setdefault(key, []).append((start, end))

    def _release(self, key: str | int, spans: list[_Span]) -> list[Callable[[], object]]:
        """Drop hold `key` on `spans`; return the waiters it set free (call them unlocked)."""
        touched = set()
        for storage, _, _ in spans:
            holds = self._held.get(storage)
            if holds is not None and holds.pop(key, None) is not None:
                touched.add(storage)
                if not holds:
                    del self._held[storage]
        if not touched or not self._waiters:
            return []
        ready, waiting = [], []
        for waiter in self._waiters:
            wanted = waiter[0]
            if any(s[0] in touched for s in wanted) and not self._overlaps(wanted):
                ready.append(waiter[1])
            else:
                waiting.append(waiter)
        self._waiters = waiting
        return ready

    def _overlaps(self, spans: list[_Span]) -> bool:
        return self._holder(spans) is not None

    def _holder(self, spans: list[_Span]) -> str | int | None:
        """The key of a hold on a byte of `spans` (under the lock), or None."""
        if self._unseen or self._unseen_objects:
            self._see()
        for storage, start, end in spans:
            for key, ranges in self._held.get(storage, {}).items():
                if any(s < end and start < e for s, e in ranges):
                    return key
        return None

    def _see(self) -> None:
        """Hold the bytes of the objects being made that nobody looked at yet (under the lock)."""
        for key, tensors in self._unseen.items():
            self._seen[key] = spans = _spans(tensors)
            self._hold(key, spans)
        self._unseen.clear()
        for obj_id, stored in self._unseen_objects.items():
            self._hold(obj_id, _spans_of(stored))
        self._unseen_objects.clear()

    def holding(self, tensors: Sequence[torch.Tensor]) -> _Holding:
        """Hold `tensors` for a `with` block (an object being made).

        Their byte ranges are worked out only if a waiter looks meanwhile: most objects are
        made with nobody waiting, and a small object's return pays for every step it takes.
        """
        return _Holding(self, tensors)

    def hold(self, tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Hold `tensors` (as `holding` does) until the function returned is called, once."""
        holding = _Holding(self, tensors)
        holding.__enter__()
        return functools.partial(holding.__exit__, None, None, None)

    def _unhold(self, key: int) -> None:
        with self._lock:
            if self._unseen.pop(key, None) is not None:
                return  # nobody looked: no waiter can be waiting on it
            ready = self._release(key, self._seen.pop(key))
        _wake(ready)

    @contextlib.contextmanager
    def reading(self, obj_id: str) -> Iterator[StoredObject | None]:
        """Yield the stored object (None if gone), its tensors held until the block ends."""
        with self._lock:
            stored = self._objects.get(obj_id)
            key = next(self._keys)
            if stored is not None:
                self._hold(key, _spans_of(stored))
        try:
            yield stored
        finally:
            if stored is not None:
                with self._lock:
                    ready = self._release(key, _spans_of(stored))
                _wake(ready)

    @contextlib.contextmanager
    def serving(self, obj_id: str, kept: dict[str, list[torch.Tensor]]) -> Iterator[list[torch.Tensor] | None]:
        """For a transport's send from the tensors it `kept` (by object id): yield them, the
        object held until the block ends, or None if it was freed. A free meanwhile makes
        wait_tensor_freed wait for the send, which reads the producer's own storage, so no
        write in place tears it. An object the store never held (a transport driven alone,
        as in its contract tests) is served from `kept` as it is."""
        with self.reading(obj_id) as stored:
            yield None if stored is None and self.was_freed(obj_id) else kept.get(obj_id)

    # -- objects -----------------------------------------------------------------------

    def add(self, obj_id: str, stored: StoredObject) -> None:
        """Keep `stored` under `obj_id`, its bytes held until it is freed (worked out only
        once a waiter looks: most objects are freed with nobody waiting)."""
        with self._lock:
            self._objects[obj_id] = stored
            self._unseen_objects[obj_id] = stored
            self._bytes += stored.nbytes
            held = len(self._objects), self._bytes
        _metrics.held(*held)

    def object_ids(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    def fetched_here(self, obj_id: str) -> None:
        """A fetch in this process got the tensors of `obj_id` themselves: warn, once per
        object, where they were sent to another process too (as Ray does), at the user's
        line (`_caller.warn`). Only two-sided sends are known here; one-sided readers
        (nixl) are not seen."""
        stored = self.get(obj_id)
        if stored is not None and stored.both_ways(served=False):
            _caller.warn(shared_with_producer(obj_id))

    def get(self, obj_id: str) -> StoredObject | None:
        with self._lock:
            return self._objects.get(obj_id)

    def was_freed(self, obj_id: str) -> bool:
        with self._lock:
            return obj_id in self._freed

    def mark_freed(self, obj_id: str) -> None:
        """Remember that `obj_id` was freed, so later fetches here fail at once."""
        with self._lock:
            self._remember_freed(obj_id)

    def _remember_freed(self, obj_id: str) -> None:
        self._freed[obj_id] = None
        while len(self._freed) > 100_000:
            self._freed.popitem(last=False)

    def free(self, obj_id: str, *, last_ref: bool = False) -> bool:
        """Drop an object and release what its transports prepared; False if absent.

        `last_ref`: every ref (so every consumer's view) is gone, not an explicit free:
        transports may reuse what they prepared. Runs on: producer.
        """
        lends = False
        with self._lock:
            stored = self._objects.pop(obj_id, None)
            # One nobody has waited on yet stays unseen until its transports let go: a
            # waiter that looks meanwhile holds it (`_see`) and waits for that too.
            self._remember_freed(obj_id)
            if stored is None:  # the last ref of an object freed explicitly: its lent bytes go now
                lent = self._lent.pop(obj_id, None) if last_ref else None
                ready = self._release(obj_id, lent) if lent is not None else []
            else:
                self._bytes -= stored.nbytes
                held = len(self._objects), self._bytes
                # Consumers may view these very bytes (Transport.lends_memory): after an
                # explicit free they stay held until the last ref goes (free(last_ref=True)).
                lends = not last_ref and any(_lends(t, m) for t, m in stored.prepared.items())
                if lends:
                    self._lent[obj_id] = _spans_of(stored)
                    if self._unseen_objects.pop(obj_id, None) is not None:  # held from now on, for waiters to come
                        self._hold(obj_id, self._lent[obj_id])
        if stored is None:
            _wake(ready)
            return False
        _metrics.held(*held)
        for transport, meta in stored.prepared.items():
            try:
                (transport.recycle if last_ref else transport.garbage_collect)(obj_id, meta)
            except Exception:  # never let one transport keep the others' resources
                log.exception("rdt_async: %s could not release object %s", transport.name, obj_id)
        if not lends:
            with self._lock:  # after the transports let go: a waiter may write the tensors next
                seen = self._unseen_objects.pop(obj_id, None) is None
                ready = self._release(obj_id, _spans_of(stored)) if seen else []
            _wake(ready)
        return True

    def release_lent(self) -> None:
        """Let go of every object freed explicitly and still lent (a new Ray session: the
        last refs of the old one will never be reported)."""
        with self._lock:
            ready = [w for obj_id, spans in self._lent.items() for w in self._release(obj_id, spans)]
            self._lent.clear()
        _wake(ready)

    # -- wait_tensor_freed ---------------------------------------------------------------

    async def wait_freed(self, tensor: torch.Tensor) -> None:
        """Return once nothing holds any byte of `tensor`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()
        wake = functools.partial(loop.call_soon_threadsafe, _io.set_once, fut)
        if self._wait(tensor, wake):
            return
        try:
            await fut
        finally:
            self._forget(wake)

    def wait_freed_blocking(self, tensor: torch.Tensor, timeout: float | None) -> bool:
        """Block until nothing holds any byte of `tensor`; False if `timeout` passed first."""
        event = threading.Event()
        wake = event.set
        if self._wait(tensor, wake):
            return True
        try:
            return event.wait(timeout)
        finally:
            self._forget(wake)

    def _wait(self, tensor: torch.Tensor, wake: Callable[[], object]) -> bool:
        """Register `wake` for when `tensor` is free; True (not registered) if it is free now."""
        spans = _spans([tensor])
        with self._lock:
            if not self._overlaps(spans):
                return True
            self._waiters.append((spans, wake))
            return False

    def holder(self, tensors: Sequence[torch.Tensor]) -> tuple[int, str | int] | None:
        """The first of `tensors` whose bytes something holds, and the hold's key (an object
        id; an int: an object being made, or one being read for a send), or None."""
        with self._lock:
            if not self._held and not self._unseen and not self._unseen_objects:
                return None  # (a process that keeps nothing: most consumers)
        for i, t in enumerate(tensors):
            spans = _spans([t])
            with self._lock:
                key = self._holder(spans)
            if key is not None:
                return i, key
        return None

    def held(self, tensor: torch.Tensor) -> bool:
        """Whether anything holds a byte of `tensor` now (`wait_freed` would wait)."""
        spans = _spans([tensor])
        with self._lock:
            return self._overlaps(spans)

    def _forget(self, wake: Callable[[], object]) -> None:
        with self._lock:
            self._waiters = [w for w in self._waiters if w[1] is not wake]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            objects = list(self._objects.values())
            nbytes = self._bytes
            lent = len(self._lent)
        return {
            "objects": len(objects),
            "lent": lent,  # freed explicitly, their bytes still viewed by consumers (shm)
            "bytes": nbytes,
            "tensors": sum(len(o.tensors) for o in objects),
        }


class _Holding:
    """`Store.holding`'s hold: taken as the block starts, let go as it ends."""

    __slots__ = ("_key", "_store", "_tensors")

    def __init__(self, store: Store, tensors: Sequence[torch.Tensor]) -> None:
        self._store, self._tensors, self._key = store, tensors, -1

    def __enter__(self) -> None:
        store = self._store
        with store._lock:
            self._key = next(store._keys)
            store._unseen[self._key] = self._tensors

    def __exit__(self, *exc: object) -> None:
        self._store._unhold(self._key)


def _spans_of(stored: StoredObject) -> list[_Span]:
    if stored.spans is None:
        stored.spans = _spans(stored.tensors)
    return stored.spans


def _wake(ready: list[Callable[[], object]]) -> None:
    for wake in ready:
        try:
            wake()
        except RuntimeError:  # the waiter's loop is closed: nobody is waiting any more
            pass



def shared_with_producer(obj_id: str) -> str:
    """What the producer of `obj_id` is warned of once it fetched the object itself while
    another process fetched it too (`StoredObject.warned`)."""
    return (
        f"RDT object {obj_id} was fetched both by the process that produced it, which gets "
        "the stored tensors themselves, and by another process: writing to them in the "
        "producer changes what later fetches elsewhere receive. Clone before writing."
    )


store = Store()
