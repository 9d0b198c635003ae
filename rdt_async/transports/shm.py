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
  producer copies them once into a warm, recycled file under /dev/shm (mode 0600, a 96-bit random name; see _segments.py), a snapshot. Views of it hold the
  object too, so it is reused only once no view is left. A guardian process per
  producer unlinks what is left if the producer is killed.

A consumer keeps its mapping of either kind of file once the last view is gone, and maps
the next fetch of the same file through it, its own writes dropped first (_mappings.py):
page tables already filled read at the speed of anonymous memory.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import errno
import fcntl
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _io
from .._errors import ObjectFreedError, PeerDiedError, RDTError, TransportUnavailableError
from . import _mappings, _segments
from ._base import Channel, TransferInfo, Transport, aligned_layout, copy_into, pid_alive, view_in

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

    @property
    def nbytes(self) -> int:
        return self.size + sum(s.nbytes for s in dict.fromkeys(x for x in self.shared if x is not None))


class ShmTransport(Transport[ShmMeta]):
    """Shared memory between processes of one node (CPU tensors)."""

    name = "shm"
    devices = ("cpu",)
    one_sided = True
    pins_memory = False

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
        return self._prepare(tensors, [_shared(t) for t in tensors])

    def _prepare(self, tensors: Sequence[torch.Tensor], found: list[Shared | None]) -> ShmMeta:
        """`prepare`, with where each tensor's shared storage lies already found (`_shared`)."""
        shared = _lend(found)
        try:
            meta = self._segment([t for t, sh in zip(tensors, shared) if sh is None])
        except BaseException:
            _close_lent(ShmMeta(None, 0, (), shared))
            raise
        it = iter(meta.offsets)
        offsets = tuple(next(it) if sh is None else 0 for sh in shared)
        return ShmMeta(meta.segment, meta.size, offsets, shared if any(shared) else ())

    def prepare_lazily(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        """`prepare`, leaving the copy into a segment to the first consumer that asks for it.

        For a producer that serves requests, where consumers may as well be on other nodes
        (`auto` on a cluster of several): a copy no consumer of this node maps would cost
        every export for nothing. Shared storages are named now, as by `prepare`.
        """
        found = [_shared(t) for t in tensors]
        if all(not t.numel() or sh is not None for t, sh in zip(tensors, found)):
            return self._prepare(tensors, found)  # nothing to copy
        shared = _lend(found)
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
            made = self._segment([t for t, sh in zip(tensors, shared) if sh is None])
            it = iter(made.offsets)
            done = ShmMeta(made.segment, made.size, tuple(next(it) if sh is None else 0 for sh in shared), meta.shared)
            with _lazy_lock:
                freed = state.freed
                if not freed:
                    state.done = done
            if freed:  # freed while we copied: `_made` found no segment to release
                if made.segment is not None:
                    _segments.pool.discard(made.segment)
                raise ObjectFreedError(f"object {obj_id} was freed while it was fetched", obj_id=obj_id)
            return done

    def _segment(self, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        """Copy `tensors` into a warm segment of the pool (see _segments.py)."""
        offsets, size = aligned_layout((t.numel() * t.element_size() for t in tensors), ALIGN)
        if size == 0:
            return ShmMeta(None, 0, tuple(offsets))
        ensure_guardian()
        try:
            seg = _segments.pool.take(size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _no_room(size, exc) from exc
            raise
        try:
            for t, off in zip(tensors, offsets):
                if t.numel():
                    dst = torch.frombuffer(seg.mm, dtype=t.dtype, count=t.numel(), offset=off)
                    dst.view(t.shape).copy_(t)
                    del dst
        except BaseException:
            _segments.pool.discard(seg.name)
            raise
        return ShmMeta(seg.name, size, tuple(offsets))

    def receive_nowait(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if info.meta.lazy:
            return None  # the producer makes the segment first
        if info.meta.size > NOWAIT_BYTES or (buffers is not None and info.meta.nbytes > NOWAIT_BYTES):
            return None  # a copy would block: take the I/O loop path
        views = _map(info)
        return views if buffers is None else copy_into(buffers, views)

    async def receive(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        if info.meta.lazy:
            info = dataclasses.replace(info, meta=await channel.request_send("export"))
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


def _open(info: TransferInfo[ShmMeta]) -> int:
    """Open the object's segment for reading; fail if its producer has died.

    The segment outlives a killed producer until its guardian unlinks it. Once the fd
    is open the data stays readable, so a producer alive after the open means the
    fetch is good; a dead one fails the fetch at once, whatever the guardian's pace.
    """
    segment = info.meta.segment
    assert segment is not None
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDONLY)
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
            buf = _mappings.cache.open(fd, info.hold)  # a segment is reused once no view of it is left
        finally:
            os.close(fd)
    storages: dict[Shared, torch.Tensor] = {}  # one mapping per storage, whatever its views
    out = []
    for i, (spec, off) in enumerate(zip(info.specs, meta.offsets)):
        sh = meta.shared[i] if meta.shared else None
        if sh is None:
            out.append(view_in(buf, spec, off))
            continue
        key = dataclasses.replace(sh, offset=0, stride=())
        if key not in storages:
            storages[key] = _map_shared(info, sh)
        base = storages[key]
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype))
        else:
            whole = base.numel() - base.numel() % spec.dtype.itemsize  # (a storage of 4 MiB + 3 bytes)
            out.append(base[:whole].view(spec.dtype).as_strided(spec.shape, sh.stride, sh.offset))
    return out


def _open_shared(info: TransferInfo[ShmMeta], sh: Shared) -> int:
    """Open the producer's shared storage read-only, checking it is still the one meant.

    Raises: PeerDiedError if the producer is gone; ObjectFreedError if the descriptor no
    longer names that storage (the object was freed and its storage released).
    """
    try:
        fd = os.open(f"/proc/{sh.pid}/fd/{sh.fd}", os.O_RDONLY)
    except FileNotFoundError:
        if not pid_alive(sh.pid):
            raise PeerDiedError(f"fetch over shm: the producer of {info.obj_id} died", obj_id=info.obj_id) from None
        raise ObjectFreedError(f"object {info.obj_id} was freed (its storage is gone)", obj_id=info.obj_id) from None
    except PermissionError as exc:
        os_error = f"{type(exc).__name__}: {exc}"
        raise TransportUnavailableError(
            f"transport 'shm' cannot open the producer's shared storage ({os_error}): the producer "
            "runs as another user or /proc is restricted; use tensor_transport='object_store'"
        ) from exc
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != sh.inode:  # (another file under that number: the pid was reused,
        os.close(fd)                        # or the storage released and the number taken again)
        if not pid_alive(sh.pid):
            raise PeerDiedError(f"fetch over shm: the producer of {info.obj_id} died", obj_id=info.obj_id)
        raise ObjectFreedError(f"object {info.obj_id} was freed (its storage is gone)", obj_id=info.obj_id)
    # Opened and the same file: its bytes are the object's, whether or not the producer
    # is still alive at this instant (a dead process's descriptors are gone from /proc).
    return fd


def _map_shared(info: TransferInfo[ShmMeta], sh: Shared) -> torch.Tensor:
    """The whole shared storage, mapped copy-on-write, as bytes; the mapping holds the object."""
    fd = _open_shared(info, sh)
    try:
        buf = _mappings.cache.open(fd, info.hold)  # views keep the buffer, the buffer keeps the object
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8, count=sh.nbytes)


def _no_room(size: int, exc: OSError) -> TransportUnavailableError:
    """`exc` from making a segment of `size` bytes, said as what to do about it."""
    try:
        st = os.statvfs(_segments.SHM_DIR)
        free = f"{st.f_bavail * st.f_frsize / (1 << 20):.0f} MiB free of {st.f_blocks * st.f_frsize / (1 << 20):.0f} MiB"
    except OSError:
        free = "its size unknown"
    return TransportUnavailableError(
        f"transport 'shm' is unavailable: {_segments.SHM_DIR} has no room for {size / (1 << 20):.1f} MiB "
        f"({free}; {exc.strerror or exc}): give it more (Docker: `docker run --shm-size=...`; "
        "Kubernetes: an emptyDir volume with medium Memory at /dev/shm), or return with "
        "tensor_transport='object_store'"
    )


_said_no_room = False


def say_no_room(exc: TransportUnavailableError, then: str) -> None:
    """Log, once per process, that `auto` found no room in /dev/shm (`exc`) and what it does `then`."""
    global _said_no_room
    if not _said_no_room:
        _said_no_room = True
        log.warning("rdt_async: auto: %s; %s", exc, then)


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


def _lend(found: list[Shared | None]) -> tuple[Shared | None, ...]:
    """`found` (each tensor's shared storage, or None: copy it) named through descriptors of
    this object's own (one per storage, closed at its free: a fetch after that finds
    nothing at the number and says freed)."""
    if not any(found):
        return tuple(found)
    own: dict[int, int] = {}
    out: list[Shared | None] = []
    try:
        for sh in found:
            if sh is not None:
                if sh.fd not in own:
                    own[sh.fd] = fcntl.fcntl(sh.fd, fcntl.F_DUPFD_CLOEXEC, 0)
                sh = dataclasses.replace(sh, fd=own[sh.fd])
            out.append(sh)
    except OSError as exc:  # out of descriptors: copy them all instead
        for fd in own.values():
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


def _shared(t: torch.Tensor) -> Shared | None:
    """Where `t` lies if its storage is shared by descriptor; None if it must be copied.

    Only storages that `share_memory_()` (torch's file-descriptor strategy) put in shared
    memory; never one this call would move (`_share_fd_cpu_` moves what it finds elsewhere).
    """
    storage = t.untyped_storage()
    if not storage.is_shared() or t.device.type != "cpu" or t.layout != torch.strided:
        return None  # (is_shared first: it is the cheap test that fails for most tensors)
    if t.is_conj() or t.is_neg() or storage.nbytes() < SHARE_MIN_BYTES:
        return None  # a lazy conjugate or negation lives in the tensor, not its bytes: copy it resolved
    try:
        fd: int = storage._get_shared_fd()  # type: ignore[attr-defined]  # the descriptor it keeps; never moves it
    except RuntimeError:  # shared another way (torch's file_system strategy)
        return None
    if fd < 0:  # mapped from a file that kept no descriptor (torch.from_file)
        return None
    st = os.fstat(fd)
    return Shared(os.getpid(), fd, (st.st_dev, st.st_ino), storage.nbytes(), int(t.storage_offset()), tuple(t.stride()))


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
    for b, spec, ok, sh in zip(buffers, info.specs, direct, shared):
        if ok and spec.nbytes and sh is not None:
            fd = _open_shared(info, sh)
            try:
                _pread_exact(fd, b, sh.offset * spec.dtype.itemsize, spec.nbytes)
            finally:
                os.close(fd)
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
