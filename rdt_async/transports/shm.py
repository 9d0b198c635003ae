"""`shm`: one-sided transfers through POSIX shared memory on one node.

Two ways a tensor's bytes reach a consumer of the same node, both mapped copy-on-write
(MAP_PRIVATE: no copy at fetch time, a consumer's writes stay its own):

- Shared storages. A storage of at least SHARE_MIN_BYTES that the user put in shared
  memory (`tensor.share_memory_()`, once, e.g. a trainer's weights at creation) is
  exported without a copy: the metadata names the producer's descriptor of it, and a
  consumer maps it through /proc/<pid>/fd (checking the inode). rdt_async never moves a
  storage itself (moving frees memory a concurrent reader may be reading); a storage
  returned again unshared is copied, and the producer says once how to stop that. Such
  a view shows the producer's memory, so it keeps its object (the RDTObject rides on the
  mapping): while any consumer holds one, the producer holds the tensor and
  `wait_tensor_freed` waits, even after an explicit `free`. A trainer that waits before
  each in-place update never changes what a consumer reads; a consumer that keeps a
  fetched tensor keeps that version and holds up the update until it drops it.
- A segment for the rest (smaller storages, storages not in shared memory): the
  producer copies them once into a warm, recycled file under /dev/shm (mode 0600, named
  for its object with a per-object secret; see _segments.py), a snapshot. Views of it hold the
  object too, so it is reused only once no view is left. A guardian process per
  producer unlinks what is left if the producer is killed.

A consumer keeps its mapping of either kind of file once the last view is gone, and maps
the next fetch of the same file through it, its own writes dropped first (_mappings.py):
page tables already filled read at the speed of anonymous memory.

A consumer trusts none of the metadata (it came from another process): it opens only the
segment whose name the ref's producer makes for that object and secret, relative to
/dev/shm, never through a link; it maps a shared storage only through a descriptor the
producer lent for that object (attested by its file position, a secret of the object);
and every size, offset and stride must lie within the file (`_checked`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import _io
from .._errors import ObjectFreedError, PeerDiedError, RDTError, TransferError, TransportUnavailableError
from .._local import aligned_layout, copy_into, copy_to, pid_alive, view_in
from . import _mappings, _segments
from ._base import (
    MAX_SPEC_BYTES,
    Channel,
    Cost,
    TensorSpec,
    TransferInfo,
    Transport,
)

log = logging.getLogger("rdt_async")

SHM_DIR = "/dev/shm"
PREFIX = "rdt-"
ALIGN = 64
# Segments up to this size are mapped (and copied into buffers) on the caller's thread.
NOWAIT_BYTES = 1 << 20
# Reads into buffers from this size use two threads.
SPLIT_READ_BYTES = 16 << 20

# Runs in the guardian: detach from the producer's process tree, sweep what dead
# producers of our PID namespace left, then wait for our producer's end (EOF on stdin)
# and sweep its files. Names: `<pfx><pid>-<pid namespace>-...` (_segments.name_prefix).
_GUARDIAN = r"""
import os, sys
if os.fork(): os._exit(0)
os.setsid()
d, pfx, me, ns = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def alive(pid):
    try: os.kill(int(pid), 0)
    except ProcessLookupError: return False
    except (PermissionError, ValueError): return True
    return True
def sweep(only):
    for n in os.listdir(d):
        parts = n[len(pfx):].split("-", 2) if n.startswith(pfx) else []
        if len(parts) < 3 or parts[1] != ns:
            continue  # not ours, or made in another PID namespace: its pids mean nothing here
        if parts[0] == only or (only is None and not alive(parts[0])):
            try: os.unlink(os.path.join(d, n))
            except OSError: pass
sweep(None)
sys.stdin.buffer.read()
sweep(me)
"""


# Storages from this size on, once in shared memory, are exported without a copy.
SHARE_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Shared:
    """A tensor in a shared storage of the producer: how a consumer finds and views it."""

    pid: int
    fd: int
    inode: tuple[int, int]  # (st_dev, st_ino) of the storage's file: the fd is still it
    nbytes: int  # the storage's
    offset: int  # the tensor's, in elements
    stride: tuple[int, ...]
    # The random part of the file position of the descriptor lent for this object
    # (KEY_MIN <= key < KEY_END): the position is `_position(key, obj_id, views)`, the views
    # being every tensor the object lends through that descriptor. A consumer reads it in
    # /proc/<pid>/fdinfo, so a descriptor the producer did not lend for this object, or
    # with other views of it, is never mapped.
    key: int = 0


KEY_MIN, KEY_END = 1 << 40, 1 << 62  # far beyond any position a file of ours reaches


def _position(key: int, obj_id: str, views: tuple[Any, ...]) -> int:
    """The file position a descriptor lent for object `obj_id` with `key`, through which
    the object lends `views` ((shape, dtype, offset, stride, storage bytes) each, in
    order), is set to."""
    what = repr((key, obj_id, views)).encode("utf-8", "surrogatepass")
    return KEY_MIN + int.from_bytes(hashlib.blake2b(what, digest_size=8).digest(), "little") % (KEY_END - KEY_MIN)


def _views(specs: Sequence[Any], shared: Sequence[Shared | None]) -> dict[int, tuple[Any, ...]]:
    """The views an object lends through each of its descriptors (`_position`'s `views`), by
    descriptor: one pass over its tensors (16,000 separately shared ones: 16,000 descriptors).
    `specs`: each tensor's (or its TensorSpec's) shape and dtype. The dtype is bound with
    the offset and strides, which count its elements: a ref with another dtype (the
    same view of other bytes) names no position the producer set."""
    by: dict[int, list[Any]] = {}
    for spec, sh in zip(specs, shared):
        if sh is not None:
            by.setdefault(sh.fd, []).append((tuple(spec.shape), str(spec.dtype), sh.offset, tuple(sh.stride), sh.nbytes))
    return {fd: tuple(views) for fd, views in by.items()}
MAX_FD = 1 << 20


@dataclass(frozen=True)
class ShmMeta:
    """Where an object's tensors lie: segment name, its size, each tensor's offset in it,
    or (for tensors in shared storages) where that storage is. `lazy`: the segment is
    made at the first fetch that asks the producer for it (see `prepare_lazily`)."""

    segment: str | None
    size: int
    offsets: tuple[int, ...]
    shared: tuple[Shared | None, ...] = ()
    lazy: bool = False
    key: str = ""  # the object's secret: the segment is named `_segments.name_for(obj_id, key, size, layout)`

    @property
    def nbytes(self) -> int:
        return self.size + sum(s.nbytes for s in dict.fromkeys(x for x in self.shared if x is not None))


class ShmTransport(Transport[ShmMeta]):
    """Shared memory between processes of one node (CPU tensors)."""

    name = "shm"
    devices = ("cpu",)
    one_sided = True
    reach = "node"
    auto_prepares = True  # auto's path on the producer's node (a warm copy, or none: share_memory_())
    auto_costs: ClassVar[Mapping[str, Cost]] = {"cpu/node": Cost(0.0039, 2.30)}  # (how measured: transports/_auto.py)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not os.path.isdir(SHM_DIR):
            return f"{SHM_DIR} does not exist (shm needs Linux)"
        return None

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        # The segment's file is gone: unlinked at free, or by the dead producer's guardian.
        return ObjectFreedError if isinstance(exc, FileNotFoundError) else None

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        note_returned(tensors)
        return self._prepare(obj_id, tensors, _shared_all(tensors))

    def _prepare(self, obj_id: str, tensors: Sequence[torch.Tensor], found: list[Shared | None]) -> ShmMeta:
        """`prepare`, with where each tensor's shared storage lies already found (`_shared`)."""
        shared = _lend(obj_id, tensors, found)
        try:
            meta = self._segment(obj_id, [t for t, sh in zip(tensors, shared) if sh is None])
        except BaseException:
            _close_lent(ShmMeta(None, 0, (), shared))
            raise
        it = iter(meta.offsets)
        offsets = tuple(next(it) if sh is None else 0 for sh in shared)
        return ShmMeta(meta.segment, meta.size, offsets, shared if any(shared) else (), key=meta.key)

    def prepare_lazily(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        """`prepare`, leaving the copy into a segment to the first consumer that asks for it.

        For a producer that serves requests, where consumers may as well be on other nodes
        (`auto` on a cluster of several): a copy no consumer of this node maps would cost
        every export for nothing. Shared storages are named now, as by `prepare`.
        """
        note_returned(tensors)
        found = _shared_all(tensors)
        if all(not t.numel() or sh is not None for t, sh in zip(tensors, found)):
            return self._prepare(obj_id, tensors, found)  # nothing to copy
        shared = _lend(obj_id, tensors, found)
        with _lazy_lock:
            _lazy[obj_id] = _Lazy()
        return ShmMeta(None, 0, (), shared if any(shared) else (), lazy=True)

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: ShmMeta | None, request: Any
    ) -> ShmMeta:
        """Export a lazily prepared object now (once, whoever asks first): its metadata."""
        assert meta is not None and meta.lazy
        return await _io.to_thread(self._export, obj_id, tensors, meta)

    def _export(self, obj_id: str, tensors: Sequence[torch.Tensor], meta: ShmMeta) -> ShmMeta:
        with _lazy_lock:
            state = _lazy.get(obj_id)
        if state is None:  # freed before its first fetch got here
            raise ObjectFreedError(f"object {obj_id} was freed before it was fetched", obj_id=obj_id)
        with state.lock:  # one export, whoever asks first; the others wait for it
            if state.done is not None:
                return state.done
            shared = meta.shared or (None,) * len(tensors)
            made = self._segment(obj_id, [t for t, sh in zip(tensors, shared) if sh is None])
            it = iter(made.offsets)
            offsets = tuple(next(it) if sh is None else 0 for sh in shared)
            done = ShmMeta(made.segment, made.size, offsets, meta.shared, key=made.key)
            with _lazy_lock:
                freed = state.freed
                if not freed:
                    state.done = done
            if freed:  # freed while we copied: `_made` found no segment to release
                if made.segment is not None:
                    _segments.pool.discard(made.segment)
                raise ObjectFreedError(f"object {obj_id} was freed while it was fetched", obj_id=obj_id)
            return done

    def _segment(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        """Copy `tensors` into a warm segment of the pool, named for `obj_id` (see _segments.py)."""
        offsets, size = aligned_layout((t.numel() * t.element_size() for t in tensors), ALIGN)
        if size == 0:
            return ShmMeta(None, 0, tuple(offsets))
        ensure_guardian()
        key = _segments.new_key()
        try:
            sizes = [t.numel() * t.element_size() for t in tensors]
            layout = [(off, n) for off, n in zip(offsets, sizes) if n]
            seg = _segments.pool.take(size, _segments.name_for(obj_id, key, size, layout))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _no_room(size, exc) from exc
            raise
        try:
            copy_to(seg.mm, tensors, offsets)
        except BaseException:
            _segments.pool.discard(seg.name)
            raise
        return ShmMeta(seg.name, size, tuple(offsets), key=key)

    def receive_nowait(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if _checked(info).lazy:
            return None  # the producer makes the segment first
        if info.meta.size > NOWAIT_BYTES or (buffers is not None and info.meta.nbytes > NOWAIT_BYTES):
            return None  # a copy would block: take the I/O loop path
        views = _map(info)
        return views if buffers is None else copy_into(buffers, views)

    async def receive(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        if _checked(info).lazy:
            info = dataclasses.replace(info, meta=await channel.request_send("export"))
            if _checked(info).lazy:
                raise TransferError(f"shm fetch of {info.obj_id}: the producer's export is still lazy", obj_id=info.obj_id)
        if buffers is None:
            return _map(info)  # each view keeps the private mapping alive
        return await _io.to_thread_finished(_read_into, info, buffers)

    def garbage_collect(self, obj_id: str, meta: ShmMeta) -> None:
        # A segment freed explicitly may still be viewed somewhere: unlinked, never reused.
        # The object's descriptors of shared storages close: a later fetch finds it freed.
        _close_lent(meta)
        segment = _made(obj_id, meta)
        if segment is not None:
            _segments.pool.discard(segment)

    def recycle(self, obj_id: str, meta: ShmMeta) -> None:
        _close_lent(meta)
        segment = _made(obj_id, meta)
        if segment is not None:
            _segments.pool.recycle(segment)  # no view of it is left anywhere

    def lends_memory(self, meta: ShmMeta) -> bool:
        return any(sh is not None for sh in meta.shared)  # consumers map the producer's storage


def _made(obj_id: str, meta: ShmMeta) -> str | None:
    """The object's segment, if one was made (at prepare, or at its first fetch if lazy)."""
    if not meta.lazy:
        return meta.segment
    with _lazy_lock:
        state = _lazy.pop(obj_id, None)
        if state is None:
            return None
        state.freed = True  # an export under way releases its segment itself
        return state.done.segment if state.done is not None else None


class _Lazy:
    """A lazily prepared object, from `prepare_lazily` until its free: its export's lock
    (concurrent first fetches make one segment), the export once made, whether freed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: ShmMeta | None = None
        self.freed = False  # under _lazy_lock


_lazy: dict[str, _Lazy] = {}
_lazy_lock = threading.Lock()

_guardian: tuple[subprocess.Popen[bytes], int] | None = None  # and the pid it guards
_guardian_lock = threading.Lock()


def ensure_guardian() -> None:
    """Start this process's guardian once: it unlinks our `PREFIX<pid>-<pid ns>-*` files when we end.

    Runs on: producer (shm segments, cuda_ipc's liveness tables).
    """
    global _guardian
    if _guardian is not None and _guardian[1] == os.getpid():
        return
    with _guardian_lock:
        if _guardian is not None and _guardian[1] == os.getpid():
            return
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARDIAN, SHM_DIR, PREFIX, str(os.getpid()), _segments.pid_namespace()],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        proc.wait()  # the first child exits at once; its detached child keeps stdin
        assert proc.stdin is not None
        atexit.register(proc.stdin.close)  # at exit, as at death: the guardian cleans up
        _guardian = (proc, os.getpid())


def _forked_child() -> None:
    """In a child forked from a producer: close the inherited end of the parent's guardian
    pipe (the guardian sweeps the parent's files once every end is closed: a forked worker
    that outlived the parent kept them until it ended). The child starts its own guardian."""
    guardian = _guardian
    if guardian is not None and guardian[1] != os.getpid() and guardian[0].stdin is not None:
        with contextlib.suppress(OSError):
            guardian[0].stdin.close()


os.register_at_fork(after_in_child=_forked_child)


def _checked(info: TransferInfo[Any]) -> ShmMeta:
    """Refuse metadata that its producer did not make for this object: types, the segment's
    name, every size, offset and stride. Return the metadata.

    Runs on: consumer, before anything is opened (microseconds: no system call).
    Raises: TransferError naming the field.
    """
    meta, specs, obj_id = info.meta, info.specs, info.obj_id

    def bad(what: str) -> TransferError:
        return TransferError(f"shm fetch of {obj_id}: refused metadata: {what}", obj_id=obj_id)

    if type(meta) is not ShmMeta:
        raise bad(f"a {type(meta).__name__}, not ShmMeta")
    lazy, shared, offsets, size = meta.lazy, meta.shared, meta.offsets, meta.size
    if type(lazy) is not bool or type(shared) is not tuple or (shared and len(shared) != len(specs)):
        raise bad(f"shared storages {shared!r} do not match its {len(specs)} tensor(s)")
    if not lazy and (type(offsets) is not tuple or len(offsets) != len(specs)):
        raise bad(f"offsets {offsets!r} do not match its {len(specs)} tensor(s)")
    if type(size) is not int or not 0 <= size <= MAX_SPEC_BYTES:
        raise bad(f"size {size!r}")
    in_segment = False
    for i, spec in enumerate(specs):
        sh = shared[i] if shared else None
        if sh is not None:
            _check_shared(sh, spec, i, info.producer_pid, bad)
        elif not lazy and spec.nbytes:
            off = offsets[i]
            if type(off) is not int or off < 0 or off % ALIGN or off + spec.nbytes > size:
                raise bad(f"tensor {i} at offset {off!r} ({spec.nbytes} bytes) in a segment of {size}")
            in_segment = True
    if lazy or meta.segment is None:
        if in_segment:
            raise bad("tensors in a segment, and no segment")
        return meta
    layout = [(off, s.nbytes) for s, off, sh in zip(specs, offsets, shared or [None] * len(specs)) if sh is None and s.nbytes]
    _check_name(meta, obj_id, layout, info.producer_pid, bad)
    return meta


def _check_name(meta: ShmMeta, obj_id: str, layout: list[tuple[int, int]], producer_pid: int | None, bad: Any) -> None:
    """The segment's name must be the one the producer gives this object (`_segments.name_for`)."""
    segment, key = meta.segment, meta.key
    m = _segments.SEGMENT_NAME.fullmatch(segment) if type(segment) is str else None
    if m is None:
        raise bad(f"segment {segment!r} is not a name of ours ({PREFIX}<pid>-<pid namespace>-<24 hex>)")
    pid = int(m[1])
    if producer_pid is not None and pid != producer_pid:
        raise bad(f"segment {segment!r} was made by process {pid}, not by the producer (process {producer_pid})")
    if type(key) is not str or not _segments.KEY.fullmatch(key) or type(obj_id) is not str:
        raise bad("the object's key is missing or malformed")
    if type(meta.size) is not int or segment != _segments.name_for(obj_id, key, meta.size, layout, pid, m[2]):
        raise bad(
            f"segment {segment!r} is not the one its producer makes for object {obj_id} of {meta.size!r} bytes "
            "with tensors of the sizes its specs say"
        )


def _check_shared(sh: Any, spec: TensorSpec, i: int, producer_pid: int | None, bad: Any) -> None:
    """A shared storage's fields, and the tensor's view of it, within the storage."""
    if type(sh) is not Shared:
        raise bad(f"tensor {i}'s storage is a {type(sh).__name__}, not Shared")
    fields = (sh.pid, sh.fd, sh.nbytes, sh.offset, sh.key)
    if type(sh.inode) is not tuple or type(sh.stride) is not tuple:
        raise bad(f"tensor {i}'s storage has an inode or stride that is not a tuple: {sh!r}")
    if not all(type(x) is int for x in fields) or not all(type(x) is int for x in (*sh.inode, *sh.stride)):
        raise bad(f"tensor {i}'s storage has fields that are not ints: {sh!r}")
    if producer_pid is not None and sh.pid != producer_pid:
        raise bad(f"tensor {i}'s storage is in process {sh.pid}, not in the producer (process {producer_pid})")
    if not 0 <= sh.fd < MAX_FD or not KEY_MIN <= sh.key < KEY_END or len(sh.inode) != 2:
        raise bad(f"tensor {i}'s storage descriptor {sh.fd}, key or inode is not one a producer lends")
    if not 0 <= sh.nbytes <= MAX_SPEC_BYTES or len(sh.stride) != len(spec.shape) or sh.offset < 0:
        raise bad(f"tensor {i}'s view {list(spec.shape)}, stride {sh.stride} of a storage of {sh.nbytes} bytes")
    if spec.nbytes:
        if min(sh.stride, default=0) < 0:
            raise bad(f"tensor {i}'s stride {sh.stride} is negative")
        if _end(spec, sh) > sh.nbytes:
            raise bad(
                f"tensor {i} ({list(spec.shape)}, stride {sh.stride}, offset {sh.offset}) reaches past its "
                f"storage of {sh.nbytes} bytes"
            )


def _open(info: TransferInfo[ShmMeta]) -> int:
    """Open the object's segment for reading (checked by `_checked` already); fail if its
    producer has died.

    The segment outlives a killed producer until its guardian unlinks it. Once the fd
    is open the data stays readable, so a producer alive after the open means the
    fetch is good; a dead one fails the fetch at once, whatever the guardian's pace.
    Raises: FileNotFoundError (freed), TransferError (not a file the producer made), PeerDiedError.
    """
    segment = info.meta.segment
    assert segment is not None
    fd = _segments.open_own(segment, info.meta.size, f"shm fetch of {info.obj_id}", info.obj_id)
    made_by = _segments.owner(segment)
    if made_by is not None and made_by[1] == _segments.pid_namespace() and not pid_alive(made_by[0]):
        os.close(fd)
        raise PeerDiedError(f"fetch over shm: the producer of {info.obj_id} died", obj_id=info.obj_id)
    return fd


def _map(info: TransferInfo[ShmMeta]) -> list[torch.Tensor]:
    """Map the segment and shared storages copy-on-write; return a view per tensor (no copy)."""
    meta = info.meta
    buf: Any = None
    if meta.segment is not None:
        fd = _open(info)
        try:
            buf = _mappings.cache.open(fd, info.hold, named=True)  # a segment is reused once no view of it is left
        finally:
            os.close(fd)
    storages: dict[tuple[Any, ...], Any] = {}  # one mapping per storage, whatever its views
    lent = _views(info.specs, meta.shared) if meta.shared else {}
    out = []
    for i, (spec, off) in enumerate(zip(info.specs, meta.offsets)):
        sh = meta.shared[i] if meta.shared else None
        if sh is None:
            out.append(view_in(buf, spec, off))
            continue
        key = (sh.pid, sh.fd, sh.inode, sh.nbytes, sh.key)  # the storage, not the view
        if key not in storages:
            storages[key] = _map_shared(info, sh, lent)
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype))
        else:
            out.append(_lent_view(storages[key], spec, sh))
    return out


def _lent_view(mapping: Any, spec: TensorSpec, sh: Shared) -> torch.Tensor:
    """The tensor `sh` lends of a shared storage mapped whole (`mapping`), over a storage of
    the bytes it reaches alone: the rest of the producer's storage (what its other tensors,
    or none of the object's, hold) is not reachable through it (`untyped_storage()`)."""
    first = sh.offset * spec.dtype.itemsize
    own = torch.frombuffer(mapping, dtype=torch.uint8, count=_end(spec, sh) - first, offset=first)  # (checked: within)
    return own.view(spec.dtype).as_strided(spec.shape, sh.stride, 0)


def _end(spec: TensorSpec, sh: Shared) -> int:
    """One past the last byte of its storage that a view of `spec` at `sh` reaches (it has
    elements, and no negative stride)."""
    return (sh.offset + sum((n - 1) * st for n, st in zip(spec.shape, sh.stride)) + 1) * spec.dtype.itemsize


def _open_shared(info: TransferInfo[ShmMeta], sh: Shared, views: dict[int, tuple[Any, ...]]) -> int:
    """Open the producer's shared storage read-only, checking it is still the one meant.

    The descriptor must be the one the producer lent for this object: its file position,
    read in /proc/<pid>/fdinfo, is the object's key (`_lend`). Checked before the open, so
    nothing else of the producer's is ever opened; a descriptor closed and its number
    taken again after that check shows as another inode after the open.
    Raises: TransferError (not a storage the producer lent); PeerDiedError if the producer
    is gone; ObjectFreedError if the descriptor no longer names that storage (the object
    was freed and its storage released, or the metadata names what was never lent for it).
    """
    def gone(what: str) -> RDTError:
        if not pid_alive(sh.pid):
            return PeerDiedError(f"fetch over shm: the producer of {info.obj_id} died", obj_id=info.obj_id)
        return ObjectFreedError(f"object {info.obj_id} was freed ({what})", obj_id=info.obj_id)

    try:
        lent = _lent_key(sh.pid, sh.fd)
        if lent != _position(sh.key, info.obj_id, views.get(sh.fd, ())):  # (another file under that number: the pid
            raise gone(  # reused, the object freed and the number taken again, or a ref naming what
                # was never lent for it: another object's, or other views of it)
                f"descriptor {sh.fd} of process {sh.pid} is not the one its producer lent for it"
            )
        fd = os.open(f"/proc/{sh.pid}/fd/{sh.fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise gone("its storage is gone") from None
    except PermissionError as exc:
        os_error = f"{type(exc).__name__}: {exc}"
        raise TransportUnavailableError(
            f"transport 'shm' cannot open the producer's shared storage ({os_error}): the producer "
            "runs as another user or /proc is restricted; use tensor_transport='object_store'"
        ) from exc
    except OSError as exc:  # (ENXIO: a socket)
        raise TransferError(
            f"shm fetch of {info.obj_id}: refused the shared storage /proc/{sh.pid}/fd/{sh.fd}: {exc.strerror or exc}",
            obj_id=info.obj_id,
        ) from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != sh.inode:
            raise gone("its storage is gone")
        _segments.check_file(
            st, _segments.shm_dir()[1], links=0, min_size=sh.nbytes, obj_id=info.obj_id,
            what=f"shm fetch of {info.obj_id}: refused the shared storage /proc/{sh.pid}/fd/{sh.fd}",
        )
    except BaseException:
        os.close(fd)
        raise
    # Opened and the same file: its bytes are the object's, whether or not the producer
    # is still alive at this instant (a dead process's descriptors are gone from /proc).
    return fd


_POS = re.compile(rb"pos:\s*([0-9]+)\n")


def _lent_key(pid: int, fd: int) -> int | None:
    """The file position of descriptor `fd` of process `pid` (the key it was lent with).

    Raises: FileNotFoundError if there is no such descriptor; PermissionError.
    """
    f = os.open(f"/proc/{pid}/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        m = _POS.match(os.read(f, 256))
    finally:
        os.close(f)
    return int(m[1]) if m else None


def _map_shared(info: TransferInfo[ShmMeta], sh: Shared, views: dict[int, tuple[Any, ...]]) -> Any:
    """The whole shared storage, mapped copy-on-write; the mapping holds the object."""
    fd = _open_shared(info, sh, views)
    try:
        return _mappings.cache.open(fd, info.hold)  # views keep the buffer, the buffer keeps the object
    finally:
        os.close(fd)


def _no_room(size: int, exc: OSError) -> TransportUnavailableError:
    """`exc` from making a segment of `size` bytes, said as what to do about it."""
    return TransportUnavailableError(
        f"transport 'shm' is unavailable: {_segments.SHM_DIR} has no room for {size / (1 << 20):.1f} MiB "
        f"({_segments.room()}; {exc.strerror or exc}): {_segments.MORE_ROOM}, or return with "
        "tensor_transport='object_store'"
    )



def note_returned(tensors: Sequence[torch.Tensor]) -> None:
    """Say once per process how to stop copying a large storage that is returned again.

    Runs on: producer. rdt_async never moves a storage into shared memory itself: moving
    frees the old memory, which a concurrent reader (another thread, a send, a coroutine
    while the export runs off the loop) may still be reading, and a moved storage can no
    longer grow (torch). The user, who knows when nothing else touches the tensor, can.
    """
    global _said_share
    if _said_share:
        return
    for t in tensors:
        storage = t.untyped_storage()
        if storage.is_shared() or t.device.type != "cpu" or storage.nbytes() < SHARE_MIN_BYTES:
            continue
        if storage not in _returned_once:
            _returned_once.add(storage)
            continue
        _said_share = True
        log.warning(
            "rdt_async: a tensor of %.0f MiB returned again is copied into shared memory at every "
            "return; call `tensor.share_memory_()` on it once (for instance in __init__, while "
            "nothing else reads it), and its exports over shm copy nothing",
            storage.nbytes() / (1 << 20),
        )
        return


_said_share = False
# Storages returned once, for `note_returned`: the second return of one says how to share it.
_returned_once: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()


def _lend(obj_id: str, tensors: Sequence[torch.Tensor], found: list[Shared | None]) -> tuple[Shared | None, ...]:
    """`found` (each tensor's shared storage, or None: copy it) named through descriptors of
    this object's own (one per storage, closed at its free: a fetch after that finds
    nothing at the number and says freed).

    Each is a new open of the storage's file, its position set from a random key that the
    metadata carries, the object's id and the views it lends through it (`_position`): a
    consumer maps a descriptor only if it shows that position (`_open_shared`).
    """
    if not any(found):
        return tuple(found)
    own: dict[int, tuple[int, int]] = {}
    out: list[Shared | None] = []
    try:
        for sh in found:
            if sh is not None:
                if sh.fd not in own:
                    fd = os.open(f"/proc/self/fd/{sh.fd}", os.O_RDONLY | os.O_CLOEXEC)
                    own[sh.fd] = (fd, KEY_MIN + secrets.randbelow(KEY_END - KEY_MIN))  # (positioned below)
                fd, key = own[sh.fd]
                sh = Shared(sh.pid, fd, sh.inode, sh.nbytes, sh.offset, sh.stride, key)
            out.append(sh)
        views = _views(tensors, out)
        for fd, key in own.values():
            os.lseek(fd, _position(key, obj_id, views.get(fd, ())), os.SEEK_SET)
    except OSError as exc:  # out of descriptors (or no /proc): copy them all instead
        for fd, _ in own.values():
            os.close(fd)
        log.debug("rdt_async: shm: no descriptor for a shared storage (%s): copied", exc)
        return (None,) * len(found)
    return tuple(out)


def _close_lent(meta: ShmMeta) -> None:
    for fd in {sh.fd for sh in meta.shared if sh is not None}:
        try:
            os.close(fd)
        except OSError:
            pass


def _shared_all(tensors: Sequence[torch.Tensor]) -> list[Shared | None]:
    """`_shared` of each tensor, each storage's file looked at once (a state dict's 200
    views of one publisher slot: one fstat, not 200)."""
    inodes: dict[int, tuple[int, int]] = {}
    return [_shared(t, inodes) for t in tensors]


def _shared(t: torch.Tensor, inodes: dict[int, tuple[int, int]] | None = None) -> Shared | None:
    """Where `t` lies if its storage is shared by descriptor; None if it must be copied.

    Only storages that `share_memory_()` (torch's file-descriptor strategy) put in shared
    memory; never one this call would move (`_share_fd_cpu_` moves what it finds elsewhere).
    `inodes`: the files already looked at in this batch, by descriptor.
    """
    storage = t.untyped_storage()
    if not storage.is_shared() or not t.is_cpu or t.layout != torch.strided:
        return None  # (is_shared first: it is the cheap test that fails for most tensors)
    if t.is_conj() or t.is_neg() or storage.nbytes() < SHARE_MIN_BYTES:
        return None  # a lazy conjugate or negation lives in the tensor, not its bytes: copy it resolved
    try:
        fd: int = storage._get_shared_fd()  # type: ignore[attr-defined]  # the descriptor it keeps; never moves it
    except RuntimeError:  # shared another way (torch's file_system strategy)
        return None
    if fd < 0:  # mapped from a file that kept no descriptor (torch.from_file)
        return None
    inode = None if inodes is None else inodes.get(fd)
    if inode is None:
        st = os.fstat(fd)
        inode = (st.st_dev, st.st_ino)
        if inodes is not None:
            inodes[fd] = inode
    return Shared(os.getpid(), fd, inode, storage.nbytes(), int(t.storage_offset()), tuple(t.stride()))


def _read_into(info: TransferInfo[ShmMeta], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Read the segment into the caller's buffers (blocking; run it in the pool).

    Contiguous CPU buffers are filled by pread: the kernel copies from the segment's
    pages with no page-table work on our side, at memcpy speed. Others go through a
    mapping and `copy_`.
    """
    meta = info.meta
    shared = meta.shared or (None,) * len(buffers)
    direct = [
        b.device.type == "cpu" and b.is_contiguous() and (sh is None or _contiguous(spec, sh))
        for b, spec, sh in zip(buffers, info.specs, shared)
    ]
    if meta.segment is not None:
        fd = _open(info)
        try:
            for b, spec, off, ok, sh in zip(buffers, info.specs, meta.offsets, direct, shared):
                if ok and spec.nbytes and sh is None:
                    _pread_exact(fd, b, off, spec.nbytes)
        finally:
            os.close(fd)
    opened: dict[tuple[int, int, int, tuple[int, int]], int] = {}  # each storage lent, opened once (a slot's 200 views: 1 open)
    lent_views = _views(info.specs, shared)
    try:
        for b, spec, ok, sh in zip(buffers, info.specs, direct, shared):
            if ok and spec.nbytes and sh is not None:
                key = (sh.pid, sh.fd, sh.key, sh.inode)
                lent = opened.get(key)
                if lent is None:
                    lent = opened[key] = _open_shared(info, sh, lent_views)
                _pread_exact(lent, b, sh.offset * spec.dtype.itemsize, spec.nbytes)
    finally:
        for lent in opened.values():
            os.close(lent)
    if not all(d or not spec.nbytes for d, spec in zip(direct, info.specs)):
        views = _map(info)
        for b, v, ok in zip(buffers, views, direct):
            if not ok:
                b.copy_(v)
    return buffers


def _contiguous(spec: Any, sh: Shared) -> bool:
    return tuple(sh.stride) == tuple(torch.empty(spec.shape, device="meta").stride()) or spec.nbytes == 0


def _pread_exact(fd: int, t: torch.Tensor, offset: int, nbytes: int) -> None:
    view = memoryview(t.view(-1).view(torch.uint8).numpy().data).cast("B")
    if nbytes < SPLIT_READ_BYTES:
        _pread_range(fd, view, offset, 0, nbytes)
        return
    # Two kernel copies at once (the GIL is released in preadv): one core copies at
    # about half of memcpy's speed from tmpfs pages.
    half = nbytes // 2 // ALIGN * ALIGN
    other = _io.pool(_io.SHM_READ).submit(_pread_range, fd, view, offset, half, nbytes)
    try:
        _pread_range(fd, view, offset, 0, half)
    finally:
        concurrent.futures.wait([other])  # it writes the caller's buffer, from `fd` the caller closes next
    other.result()


def _pread_range(fd: int, view: memoryview, offset: int, start: int, end: int) -> None:
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], offset + done)
        if n <= 0:
            raise OSError(f"short read of a shared memory segment at offset {offset + done}")
        done += n
