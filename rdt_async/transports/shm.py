"""`shm`: one-sided transfers through POSIX shared memory on one node.

The producer copies an object's tensors once into a fresh segment under /dev/shm
(mode 0600, a 96-bit random name). A consumer maps the segment copy-on-write
(MAP_PRIVATE): no copy at fetch time, pages are read straight from the segment, and a
consumer's writes stay its own. The producer unlinks the segment when the object is
freed; consumers' mappings outlive the name. A guardian process per producer unlinks
what is left if the producer is killed.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import _io
from .._errors import PeerDiedError
from ._base import Channel, TransferInfo, Transport, copy_into, pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "rdt-"
ALIGN = 64
# Segments up to this size are mapped (and copied into buffers) on the caller's thread.
NOWAIT_BYTES = 1 << 20
# Reads into buffers from this size use two threads.
SPLIT_READ_BYTES = 16 << 20

# Runs in the guardian: detach from the producer's process tree, sweep what dead
# producers left, then wait for our producer's end (EOF on stdin) and sweep its segments.
_GUARDIAN = r"""
import os, sys
if os.fork(): os._exit(0)
os.setsid()
d, pfx, me = sys.argv[1], sys.argv[2], sys.argv[3]
def alive(pid):
    try: os.kill(int(pid), 0)
    except ProcessLookupError: return False
    except (PermissionError, ValueError): return True
    return True
def sweep(only):
    for n in os.listdir(d):
        if n.startswith(pfx):
            pid = n[len(pfx):].split("-", 1)[0]
            if pid == only or (only is None and not alive(pid)):
                try: os.unlink(os.path.join(d, n))
                except OSError: pass
sweep(None)
sys.stdin.buffer.read()
sweep(me)
"""


@dataclass(frozen=True)
class ShmMeta:
    """Where an object's tensors lie: segment name, its size, each tensor's offset."""

    segment: str | None
    size: int
    offsets: tuple[int, ...]


class ShmTransport(Transport[ShmMeta]):
    """Shared memory between processes of one node (CPU tensors)."""

    name = "shm"
    devices = ("cpu",)
    one_sided = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not os.path.isdir(SHM_DIR):
            return f"{SHM_DIR} does not exist (shm needs Linux)"
        return None

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> ShmMeta:
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        if size == 0:
            return ShmMeta(None, 0, tuple(offsets))
        ensure_guardian()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mm:
                for t, off in zip(tensors, offsets):
                    if t.numel():
                        dst = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=off)
                        dst.view(t.shape).copy_(t)
                        del dst
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return ShmMeta(name, size, tuple(offsets))

    def receive_nowait(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if info.meta.size > NOWAIT_BYTES:
            return None  # the copy into buffers would block: take the I/O loop path
        views = _map(info)
        return views if buffers is None else copy_into(buffers, views)

    async def receive(
        self, info: TransferInfo[ShmMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        if buffers is None:
            return _map(info)  # each view keeps the private mapping alive
        return await _io.to_thread_finished(_read_into, info, buffers)

    def garbage_collect(self, obj_id: str, meta: ShmMeta) -> None:
        if meta.segment is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, meta.segment))
            except FileNotFoundError:
                pass


_guardian: tuple[subprocess.Popen[bytes], int] | None = None  # and the pid it guards
_guardian_lock = threading.Lock()


def ensure_guardian() -> None:
    """Start this process's guardian once: it unlinks our `PREFIX<pid>-*` files when we end.

    Runs on: producer (shm segments, cuda_ipc's liveness tables).
    """
    global _guardian
    if _guardian is not None and _guardian[1] == os.getpid():
        return
    with _guardian_lock:
        if _guardian is not None and _guardian[1] == os.getpid():
            return
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARDIAN, SHM_DIR, PREFIX, str(os.getpid())],
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
    if not pid_alive(int(segment[len(PREFIX) :].split("-", 1)[0])):
        os.close(fd)
        raise PeerDiedError(f"fetch over shm: the producer of {info.obj_id} died", obj_id=info.obj_id)
    return fd


def _map(info: TransferInfo[ShmMeta]) -> list[torch.Tensor]:
    """Map the segment copy-on-write and return a view per tensor (no copy)."""
    meta = info.meta
    mm: mmap.mmap | None = None
    if meta.segment is not None:
        fd = _open(info)
        try:
            mm = mmap.mmap(fd, meta.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    return [_view(mm, spec, off) for spec, off in zip(info.specs, meta.offsets)]


def _read_into(info: TransferInfo[ShmMeta], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Read the segment into the caller's buffers (blocking; run it in the pool).

    Contiguous CPU buffers are filled by pread: the kernel copies from the segment's
    pages with no page-table work on our side, at memcpy speed. Others go through a
    mapping and `copy_`.
    """
    meta = info.meta
    if meta.segment is None:
        return buffers
    direct = [b.device.type == "cpu" and b.is_contiguous() for b in buffers]
    fd = _open(info)
    try:
        for b, spec, off, ok in zip(buffers, info.specs, meta.offsets, direct):
            if ok and spec.nbytes:
                _pread_exact(fd, b, off, spec.nbytes)
    finally:
        os.close(fd)
    if not all(direct):
        views = _map(info)
        for b, v, ok in zip(buffers, views, direct):
            if not ok:
                b.copy_(v)
    return buffers


def _pread_exact(fd: int, t: torch.Tensor, offset: int, nbytes: int) -> None:
    view = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")
    if nbytes < SPLIT_READ_BYTES:
        _pread_range(fd, view, offset, 0, nbytes)
        return
    # Two kernel copies at once (the GIL is released in preadv): one core copies at
    # about half of memcpy's speed from tmpfs pages.
    half = nbytes // 2 // ALIGN * ALIGN
    other = _io.pool("shm-read", 1).submit(_pread_range, fd, view, offset, half, nbytes)
    _pread_range(fd, view, offset, 0, half)
    other.result()


def _pread_range(fd: int, view: memoryview, offset: int, start: int, end: int) -> None:
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], offset + done)
        if n <= 0:
            raise OSError(f"short read of a shared memory segment at offset {offset + done}")
        done += n


def _view(mm: mmap.mmap | None, spec, offset: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    numel = 1
    for d in spec.shape:
        numel *= d
    if numel == 0 or mm is None:
        return torch.empty(spec.shape, dtype=spec.dtype)
    return torch.frombuffer(mm, dtype=spec.dtype, count=numel, offset=offset).view(spec.shape)
