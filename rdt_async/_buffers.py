"""Check a fetch's `into=` buffers: every one is a tensor a transfer can write, or the call
is refused before anything moves.

Runs on: consumer, on the caller's thread, before a transport is chosen and before any
message leaves for the producer. A mistake in a buffer therefore never starts half a
transfer: a Gloo/NCCL pair never waits on receives that were not posted, a native
library never meets memory it cannot write, and the process never faults.

What a buffer must be, and why (docs/src/async.md says the same to users):
- a dense (strided) tensor with memory of its own: not sparse, mkldnn, nested, quantized
  (a transfer carries the values, not the quantizer), meta, or a wrapper subclass whose
  storage is not real memory (FakeTensor, DTensor);
- the object's tensor's shape and dtype;
- no lazy conjugate or negation bit (transports write raw bytes, which such a view would
  show conjugated or negated);
- elements that do not share memory, within its storage's bytes (a storage resized after
  the view was made), and memory this process may write (not a read-only mapping);
- no two buffers sharing memory, and none sharing memory with an object of this process
  other than its own tensor (a same-process fetch copies from the object's tensors).

Parameters (`requires_grad`) receive as `param.data.copy_()` would; inference tensors as
a write under `torch.inference_mode()` would: through a plain alias of the same memory,
so every transport, on any thread, writes them alike.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from . import _cuda, _io, _tree
from ._errors import few
from ._local import copy_into
from ._store import extent, store
from .transports._base import TensorSpec


def checked(specs: Sequence[TensorSpec], into: Any, skeleton: Any = None) -> list[torch.Tensor] | None:
    """`_checked`'s buffers."""
    return _checked(specs, into, skeleton)[0]


# A buffer that receives a copy of the object's tensor k once it landed: (buffer, k).
Copies = list[tuple[torch.Tensor, int]]


def _checked(
    specs: Sequence[TensorSpec], into: Any, skeleton: Any = None
) -> tuple[list[torch.Tensor] | None, list[tuple[_Span, int]], Copies, list[int]]:
    """Return the tensors to write for `into=` (None without it), each checked against
    `specs`; the bytes each reaches (with its place in `into=`, in order); the buffers
    that receive a copy once those are written; and the place in `into=` of each
    buffer, then of each of those.

    `into=` gives a buffer per tensor of the object, in order; or, where the object's
    value holds a tensor under two names (tied weights, moved once: `skeleton` says
    where), a buffer per name: one tensor of yours under those names (your model ties
    them too) receives it once, and buffers of their own receive a copy.
    Runs on: consumer, the caller's thread (microseconds a buffer; a storage not made by
    torch's allocator is looked up in /proc/self/maps once).
    Raises: TypeError for an `into=` without tensors; ValueError naming the buffer, what
    is wrong with it and the fix.
    """
    if into is None:
        return None, [], [], []
    if isinstance(into, Iterator):  # model.parameters(): flattening would see one opaque leaf
        raise TypeError(
            f"into= is an iterator ({type(into).__name__}), which rdt_async cannot look into without "
            "using it up; pass a list: into=list(model.parameters())"
        )
    into_skeleton, bufs = _tree.flatten(into)
    if not bufs and specs:
        raise TypeError(f"into= holds no tensor ({type(into).__name__} {into_skeleton!r}); pass the tensors to receive into")
    places = list(range(len(bufs)))  # of each tensor of the object, its buffer's place in `into=`
    extra: list[tuple[int, int]] = []  # (place, tensor) of buffers for a tensor's second name
    at = _by_name(into, skeleton, len(bufs)) if skeleton is not None and len(bufs) > 1 else None
    if len(bufs) != len(specs) or at is not None:
        order = _tree.slot_order(skeleton) if skeleton is not None and len(bufs) >= len(specs) else []
        if len(order) != len(bufs) or not all(type(k) is int for k in order) or sorted(set(order)) != list(range(len(specs))):
            raise ValueError(f"into= holds {len(bufs)} tensor(s) but the object has {len(specs)}: {few([str(s) for s in specs])}")
        first: dict[int, int] = {}
        for position, k in enumerate(order):
            place = position if at is None else at[position]
            if k in first:
                extra.append((place, k))
            else:
                first[k] = place
        places = [first[k] for k in range(len(specs))]
    maps = _Maps()

    def name(place: int) -> str:  # (asked on a refusal only: it walks `into`)
        where = _tree.path(into, place)
        return f"tensor {place}" if where in ("", f"[{place}]") else f"tensor {place} (into{where})"

    spans = [_check(p, bufs[p], s, maps, k, name) for k, (p, s) in enumerate(zip(places, specs))]
    checked_at = list(places)  # the place in `into=` of each span's buffer (the buffers', then the copies')
    copies: Copies = []
    for place, k in extra:
        if _tree.same_tensor(bufs[place], bufs[places[k]]):
            continue  # tied here too: written once
        spans.append(_check(place, bufs[place], specs[k], maps, k, name))
        checked_at.append(place)
        copies.append((_writer(bufs[place]), k))
    return [_writer(bufs[p]) for p in places], _check_disjoint(spans, checked_at, name), copies, checked_at


def _by_name(into: Any, skeleton: Any, count: int) -> list[int] | None:
    """The place in `into=` of the buffer for each of the value's tensors (in `skeleton`'s
    order), where both name the same tensors in another order (a state dict rebuilt, its
    keys in another order: paired by order, its tensors of one shape swapped silently);
    None where they are in one order, or name other things (then paired in order)."""
    mine = _tree.names(into)
    if mine is None or len(mine) != count:
        return None
    theirs = _tree.names(skeleton)
    if theirs is None or theirs == mine or len(theirs) != count or len(set(mine)) != count or set(theirs) != set(mine):
        return None
    place = {n: i for i, n in enumerate(mine)}
    return [place[n] for n in theirs]


def checked_writes(
    specs: Sequence[TensorSpec], into: Any, skeleton: Any = None
) -> tuple[list[torch.Tensor] | None, Writes | None]:
    """`_checked`'s buffers, and what the fetch writes: the bytes they reach, to claim
    before it writes them, and the copies to make once they are written (None without
    `into=`, or where they reach no byte)."""
    buffers, ordered, copies, places = _checked(specs, into, skeleton)
    return buffers, Writes(ordered, copies, places) if ordered else None


def every(buffers: list[torch.Tensor], writes: Writes | None) -> tuple[list[torch.Tensor], list[int] | None]:
    """Every buffer a fetch writes: `buffers`, then those that receive a copy of a tensor
    under a second name (`Writes.copies`); and each one's place in `into=`."""
    if writes is None:
        return buffers, None
    return [*buffers, *(b for b, _ in writes.copies)], writes.places


# Copies at most this large are done inline rather than in the pool.
INLINE_COPY_BYTES = 1 << 20


async def land(
    tensors: list[torch.Tensor], buffers: list[torch.Tensor] | None, device: torch.device | None, writes: Writes | None, nbytes: int
) -> list[torch.Tensor]:
    """Put a fetch's `tensors` (`nbytes` in all) where the caller asked: copied into its
    `buffers` (unless they landed there), else moved to `device`; then a tensor under two
    names copied into its second buffer (`Writes.copies`). Inline when small, else in the
    pool; device results are ready on return."""
    if not buffers and (device is None or all(t.device == device for t in tensors)) and (writes is None or not writes.copies):
        return tensors  # where the caller wants them
    return await _off_caller_streams(land_now, tensors, buffers, device, writes, nbytes=nbytes)


def land_now(
    tensors: list[torch.Tensor], buffers: list[torch.Tensor] | None, device: Any, writes: Writes | None
) -> list[torch.Tensor]:
    """`land` on this thread (a blocking call: the pool's, or the caller's for a small object)."""
    if buffers:
        tensors = copy_into(buffers, tensors)
    elif device is not None:
        tensors = [t.to(device) for t in tensors]
    if writes is not None and writes.copies:
        copy_into(*writes.tied(tensors))
    return tensors


async def _off_caller_streams(fn: Any, *args: Any, nbytes: int) -> list[torch.Tensor]:
    """Run a copy inline when small, else in the pool; device results are ready on return.

    A copy on the caller's own thread is ordered on its streams. One on the I/O loop
    (`rdt.get`) or in the pool is not, so it has finished before the caller sees it.
    """
    if nbytes > INLINE_COPY_BYTES:
        return await _io.to_thread_finished(_cuda.settled, fn, *args)
    out: list[torch.Tensor] = fn(*args)
    if _io.on_io_thread():
        await _cuda.wait(_cuda.record(out))
    return out


class Writes:
    """The bytes one fetch writes (its `into=` buffers), claimed before its first write and
    released once nothing writes them (`release`; also when the fetch is dropped unstarted).

    A fetch into bytes that another fetch of this process is writing waits for that one to
    end first: two at once would leave them a mix of both, silently (a subscriber's
    `next(into=model)` just after breaking out of a `stream(into=model)` whose fetches are
    still being cancelled; two loads of one model gathered).
    """

    __slots__ = ("__weakref__", "_release", "copies", "hi", "lo", "ordered", "places")

    def __init__(self, ordered: list[tuple[_Span, int]], copies: Copies, places: list[int]) -> None:
        self.ordered = ordered
        self.copies = copies  # a tensor under two names, into buffers of their own: copied once written
        self.places = places  # in `into=`, of each buffer, then of each copy's
        self.lo, self.hi = min(s[1] for s, _ in ordered), max(s[2] for s, _ in ordered)
        self._release: weakref.finalize[Any, Any] | None = None

    def claim_nowait(self) -> bool:
        """Claim the bytes unless another fetch writes any of them: whether they are ours."""
        return self._release is not None or self._take(None)

    async def claim(self) -> None:
        """Claim the bytes, once no other fetch writes any of them."""
        loop = asyncio.get_running_loop()
        while self._release is None:
            woken: asyncio.Future[None] = loop.create_future()
            if self._take((loop, woken)):
                return
            await woken  # the fetch in the way ended

    def _take(self, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None) -> bool:
        """Claim the bytes now, or register `waiter`: whether they are ours. The release is
        set up before the claim exists (a Ctrl-C between the two left a claim nothing
        would ever drop: the next fetch into those buffers waited for good)."""
        key = _claims.new_key()
        self._release = weakref.finalize(self, _claims.drop, key)
        if _claims.take(self, key, waiter):
            return True
        self._release.detach()
        self._release = None
        return False

    def tied(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copies to make once `tensors` (the object's, landed) are written: (buffers,
        sources), for a tensor under two names received into two buffers; empty if none."""
        return [b for b, _ in self.copies], [tensors[k] for _, k in self.copies]

    def release(self) -> None:
        """Let other fetches write the bytes (idempotent)."""
        if self._release is not None:
            self._release()

    def release_after(self, settled: concurrent.futures.Future[Any]) -> None:
        """Let other fetches write the bytes once `settled` is done, not before (a transfer
        given up on that may write them yet); `release` meanwhile does nothing."""
        held = self._release.detach() if self._release is not None else None
        self._release = None
        if held is not None:
            _, drop, args, _ = held
            settled.add_done_callback(lambda _: drop(*args))


@dataclasses.dataclass
class _Held:
    ordered: list[tuple[_Span, int]]
    lo: int
    hi: int
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]


class _Claims:
    """The bytes this process's fetches are writing, and who waits for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (fetches run on callers' loops and the I/O loop)
        self._held: dict[int, _Held] = {}
        self._keys = itertools.count()

    def new_key(self) -> int:
        return next(self._keys)  # (itertools.count: atomic under the GIL)

    def take(self, w: Writes, key: int, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None) -> bool:
        """Claim `w`'s bytes under `key`, or say False where a fetch writes one of them
        (`waiter` is then woken once that one ends)."""
        with self._lock:
            for held in self._held.values():
                if w.lo < held.hi and held.lo < w.hi and _share(w.ordered, held.ordered):
                    if waiter is not None:
                        held.waiters.append(waiter)
                    return False
            self._held[key] = _Held(w.ordered, w.lo, w.hi, [])
            return True

    def drop(self, key: int) -> None:
        with self._lock:
            held = self._held.pop(key, None)
        for loop, fut in held.waiters if held is not None else ():
            try:
                loop.call_soon_threadsafe(_io.set_once, fut)
            except RuntimeError:  # its loop is closed
                pass


def _share(a: list[tuple[_Span, int]], b: list[tuple[_Span, int]]) -> bool:
    """Whether a span of `a` shares a byte with one of `b` (each sorted, its spans disjoint)."""
    j = 0
    for span, _ in a:
        while j < len(b) and (b[j][0][0], b[j][0][2]) <= (span[0], span[1]):  # ends before this starts
            j += 1
        k = j
        while k < len(b) and (b[k][0][0], b[k][0][1]) < (span[0], span[2]):
            if overlap(span, b[k][0]):
                return True
            k += 1
    return False


_claims = _Claims()


def check_unheld(buffers: Sequence[torch.Tensor], places: Sequence[int] | None = None) -> None:
    """Refuse buffers whose bytes an object of this process still keeps for its consumers.

    A fetch into a tensor that this process returned (and has not seen freed) changes the
    value of that object under its consumers, or tears a read of it under way: a stale or
    mixed value, silently. `places`: each buffer's place in `into=` (default: in order).
    Raises: ValueError naming the object and the fix.
    """
    found = store.holder(buffers)
    if found is None:
        return
    i, key = found
    place = i if places is None else places[i]
    what = (
        f"object {key}, which this process produced and keeps for its consumers"
        if isinstance(key, str) else "an object this process is making or sending right now"
    )
    raise ValueError(
        f"into= tensor {place} shares memory with {what}: a write now would change what they read, or tear a "
        "read under way. Write it once they are done (`await rdt.wait_tensor_freed(t)`, or free the object: "
        "`rdt.free(ref)`), or receive into a buffer of its own"
    )


def check_apart(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], writes: Writes | None = None) -> None:
    """Refuse buffers that share memory with the tensors of a same-process object they
    receive (`writes`: also those that receive a copy of a tensor's second name).

    A buffer that is its own tensor (same memory, same layout) is fine: the copy changes
    nothing. Any other overlap would overwrite a source before it is read; and the others
    must not share memory with another object this process keeps (`check_unheld`).
    Raises: ValueError.
    """
    every_buffer, places = every(list(buffers), writes)
    sources = [*range(len(buffers)), *(k for _, k in (writes.copies if writes is not None else ()))]
    theirs = [_span(t) for t in tensors]
    index = _Reach(theirs)
    others = []
    for i, (b, k) in enumerate(zip(every_buffer, sources)):
        span = _span(b)
        own = span == theirs[k] and b.stride() == tensors[k].stride()
        if not own:
            others.append(i)
        for j in index.sharing(span):
            if k == j and own:
                continue
            raise ValueError(
                f"into= tensor {i if places is None else places[i]} shares memory with tensor {j} of the object "
                "it receives, which this process produced: receive into a buffer of its own (e.g. "
                "torch.empty_like(t)), or use the fetched value itself"
            )
    check_unheld([every_buffer[i] for i in others], [i if places is None else places[i] for i in others])


# (device, first byte's address, one past the last byte's address), or None: no bytes.
# The device is -1 for the CPU, a CUDA device's index, or the name of another.
_Span = tuple[int | str, int, int]


def _plain(i: int) -> str:
    return f"tensor {i}"


def _check(
    i: int, b: torch.Tensor, spec: TensorSpec, maps: _Maps, k: int | None = None, name: Callable[[int], str] = _plain
) -> _Span | None:
    """Refuse buffer `i` unless a transfer of `spec` (the object's tensor `k`, if not `i`) can
    write it; return the bytes it reaches.

    Every fetch into a model's parameters runs this for each: the usual path is a few
    attribute reads, the costly checks (maps, overlap) are taken only where they can fail.
    """
    if b.is_nested or b.layout != torch.strided or b.is_quantized or b.is_meta:
        raise ValueError(f"into= {name(i)} is {_kind(b)}: receive into a dense tensor with memory of its own, e.g. {_empty(spec)}")
    if b.shape != spec.shape or b.dtype != spec.dtype:
        raise ValueError(f"into= {name(i)} is {TensorSpec.of(b)}; the object's tensor {i if k is None else k} is {spec}")
    if b.is_conj() or b.is_neg():
        lazy = "conjugate (a .conj() view)" if b.is_conj() else "negation (a .conj().imag view)"
        raise ValueError(
            f"into= {name(i)} is a lazy {lazy}, which a transfer's raw bytes would fill wrongly: "
            f"receive into a tensor without it, e.g. {_empty(spec)}, and take the view after"
        )
    n = b.numel()
    if n == 0:
        return None
    if n > 1 and not b.is_contiguous() and torch._debug_has_internal_overlap(b) == 1:
        raise ValueError(
            f"into= {name(i)} has elements that share memory (an expand() or a zero stride): "
            "receive into a tensor with memory of its own, e.g. torch.empty_like(t)"
        )
    try:
        storage = b.untyped_storage()
        base = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage of its own
        base = 0
    if base == 0:
        raise ValueError(
            f"into= {name(i)} is a {type(b).__name__} without memory of its own to write: "
            f"receive into a dense tensor with memory of its own, e.g. {_empty(spec)}"
        )
    item = b.element_size()
    start = int(b.storage_offset()) * item
    end = start + item * (1 + sum((int(d) - 1) * int(st) for d, st in zip(b.shape, b.stride())))  # the furthest element
    held = storage.nbytes()
    if end > held:
        raise ValueError(
            f"into= {name(i)} reaches {end} bytes into a storage of {held} (the storage shrank after "
            f"the view was made, e.g. by resize_()): receive into a tensor its storage holds, e.g. {_empty(spec)}"
        )
    if b.is_cpu:
        why = _unwritable(storage, base + start, base + end, maps)
        if why == READ_ONLY:
            raise ValueError(
                f"into= {name(i)} lies in read-only memory (a mapping without write permission, e.g. "
                "mmap.mmap(..., prot=mmap.PROT_READ) or np.memmap(..., mode='r')), which a write would "
                f"kill this process for: receive into writable memory, e.g. {_empty(spec)}, or map it writable"
            )
        if why == RAY_STORE:
            raise ValueError(
                f"into= {name(i)} lies in Ray's object store (a zero-copy value of ray.get), whose objects "
                f"are immutable and shared by every reader on the node: receive into memory of your own, "
                f"e.g. {_empty(spec)} (or a .clone() of it)"
            )
        return (-1, base + start, base + end)
    return (b.get_device() if b.is_cuda else str(b.device), base + start, base + end)


def _kind(b: torch.Tensor) -> str:
    """What kind of tensor `b` is, that no transfer can write."""
    if b.is_nested:
        return "a nested tensor"
    if b.layout != torch.strided:
        return f"a {str(b.layout).removeprefix('torch.')} tensor, not a dense (strided) one"
    if b.is_quantized:
        return f"quantized ({b.dtype}): a transfer carries the values, not the scale and zero point"
    return "on the meta device, which holds no memory"


def _empty(spec: TensorSpec) -> str:
    return f"torch.empty({spec.shape!r}, dtype={spec.dtype})"


def _span(t: torch.Tensor) -> _Span | None:
    """The bytes `t` reaches, or None where it has none (no elements, no storage)."""
    found = extent(t)  # as the store reckons a hold's
    if found is None:
        return None
    storage, start, end = found
    key = -1 if t.is_cpu else t.get_device() if t.is_cuda else str(t.device)
    base = storage.data_ptr()
    return (key, base + start, base + end)


def overlap(a: _Span | None, b: _Span | None) -> bool:
    """Whether two spans (`_span`'s) share a byte."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def share(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Whether any tensor of `a` shares a byte with any of `b`."""
    index = _Reach([_span(t) for t in b])
    return any(next(index.sharing(_span(t)), None) is not None for t in a)


class _Reach:
    """Spans, indexed to tell which share a byte with a given span.

    A model's thousands of tensors against thousands: a question costs a bisection and a
    look at the spans that overlap it (and at those between them), not a pass over all.
    """

    def __init__(self, spans: Sequence[_Span | None]) -> None:
        by_device: dict[int | str, list[tuple[int, int, int]]] = {}
        for j, s in enumerate(spans):
            if s is not None:
                by_device.setdefault(s[0], []).append((s[1], s[2], j))
        # Per device: (start, end, place) by start; the starts; the furthest end so far.
        self._by: dict[int | str, tuple[list[tuple[int, int, int]], list[int], list[int]]] = {}
        for device, entries in by_device.items():
            entries.sort()
            self._by[device] = (entries, [e[0] for e in entries], list(itertools.accumulate((e[1] for e in entries), max)))

    def sharing(self, span: _Span | None) -> Iterator[int]:
        """The places of the spans that share a byte with `span`."""
        if span is None or span[0] not in self._by:
            return
        entries, starts, reach = self._by[span[0]]
        for x in range(bisect.bisect_left(starts, span[2]) - 1, -1, -1):  # those starting before it ends
            if reach[x] <= span[1]:
                return  # none of these reaches its start
            if entries[x][1] > span[1]:
                yield entries[x][2]


def _check_disjoint(spans: list[_Span | None], places: list[int], name: Callable[[int], str] = _plain) -> list[tuple[_Span, int]]:
    """Refuse into= buffers that share bytes: one's arrival would overwrite another's.
    Return the spans, each with its buffer's place in `into=` (`places`), in order."""
    ordered = sorted((s, places[i]) for i, s in enumerate(spans) if s is not None)
    reach: tuple[int | str | None, int, int, int] = (None, 0, -1, -1)  # (device, furthest end, whose, its start)
    for (dev, start, end), i in ordered:
        if dev == reach[0] and start < reach[1]:
            first, second = sorted((reach[2], i))
            a, b = name(first), name(second)
            both = f"tensors {first} and {second}" if (a, b) == (_plain(first), _plain(second)) else f"{a} and {b}"
            tied = (
                " (one tensor under two names, as tied weights are: the object holds two tensors there, "
                "so the producer's are not tied; tie them there too, or receive into buffers of their own)"
                if start == reach[3] and end == reach[1] else ""
            )
            raise ValueError(
                f"into= {both} share memory: each of the object's tensors needs a buffer "
                f"of its own{tied}"
            )
        if dev != reach[0] or end > reach[1]:
            reach = (dev, end, i, start)
    return ordered


def _writer(b: torch.Tensor) -> torch.Tensor:
    """The tensor a transport writes for buffer `b`: `b`, or a plain alias of its memory."""
    if b.is_inference():
        # torch lets only code under inference_mode() write an inference tensor, and
        # transports write on threads of their own: they get a plain tensor over the same
        # memory, written as a write under inference_mode() would be.
        alias = torch.empty(0, dtype=b.dtype, device=b.device)
        return alias.set_(b.untyped_storage(), b.storage_offset(), b.shape, b.stride())
    # Parameters (requires_grad) receive as `param.data.copy_()` would: writes through a
    # detached view of the same memory, outside autograd.
    return b.detach() if b.requires_grad else b


# Storages not made by torch's allocator whose whole memory was found writable, checked
# once each: a model's parameters fetched into at every step pay nothing after the first.
_writable_storages: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

_MAPS = "/proc/self/maps"
READ_ONLY = "read-only"
RAY_STORE = "in Ray's object store"


def _unwritable(storage: torch.UntypedStorage, start: int, end: int, maps: _Maps) -> str | None:
    """Why this process must not write the bytes [start, end) of `storage`, or None; touches none.

    A storage torch allocated (resizable) is memory of this process's own. Others
    (torch.frombuffer, torch.from_numpy, from_blob) may lie in a read-only mapping, where
    a write kills the process with SIGSEGV, or in Ray's object store (a zero-copy value
    of `ray.get`), whose objects every reader on the node maps: their mappings are read
    from /proc/self/maps (once a call, whatever the number of such storages). Without
    /proc (not Linux), nothing is refused.
    """
    if storage.resizable() or storage in _writable_storages:
        return None
    base = storage.data_ptr()
    if maps.why(base, base + storage.nbytes()) is None:
        _writable_storages.add(storage)
        return None
    return maps.why(start, end)  # a storage only partly unwritable: this view's own bytes


class _Maps:
    """This process's memory mappings, read from /proc/self/maps at the first question."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, bool, bool]] | None = None  # (lo, hi, writable, Ray's store)

    def why(self, start: int, end: int) -> str | None:
        """Why [start, end) is not writable memory of this process's own, or None."""
        if self._ranges is None:
            self._ranges = _read_maps()
        ranges = self._ranges
        if not ranges:
            return None  # no /proc: nothing known, nothing refused
        at = start
        for lo, hi, writable, ray_store in ranges[max(0, bisect.bisect_right(ranges, (at,)) - 1) :]:
            if hi <= at:
                continue
            if lo > at or not writable:
                return READ_ONLY  # a hole (unmapped) or a mapping without write permission
            if ray_store:
                return RAY_STORE
            at = hi
            if at >= end:
                return None
        return READ_ONLY


def _read_maps() -> list[tuple[int, int, bool, bool]]:
    try:
        with open(_MAPS, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(None, 5)
        lo, _, hi = fields[0].partition(b"-")
        path = fields[5].strip() if len(fields) > 5 else b""
        # Ray's store maps its files as <dir>/plasmaXXXXXX.
        out.append((int(lo, 16), int(hi, 16), fields[1][1:2] == b"w", path.rsplit(b"/", 1)[-1].startswith(b"plasma")))
    return out
