"""A consumer's copy-on-write mappings of shared files, kept warm between fetches.

A fresh mapping faults its page tables in as it is read: 256 MiB read through a new
private mapping of a tmpfs file took ~15 ms here, through one already mapped ~9 ms (the
read of anonymous memory). So a consumer keeps the mapping of a file it fetched from (a
producer's shared storage, a recycled segment) once the last view of it is gone, and
maps the next fetch of the same file (same device, inode and size) through it.

Values stay honest: pages the consumer wrote through an earlier fetch's views are its
private copies; before the mapping is reused they are found (PAGEMAP_SCAN: only the
present pages that are not the file's) and dropped, so the mapping shows the file again.
Two fetches alive at once never share a mapping (a writer through one would show
through the other). Pages the producer wrote show, as through a new mapping.

Bounded: MAX_IDLE_BYTES of idle mappings in all; one idle longer than RDT_SHM_IDLE_S
(default 10 s) is unmapped, except the newest of each tag (`open`) that `kept_tag` says
is wanted (the node relay's memfds of a producer a subscription here follows). Until then
it keeps its file's pages (a storage the producer freed). A file opened by its name (a
producer's segment) is mapped for its next fetch only while it has a name: one the
producer unlinked (freed, or let go of to make room) can never be opened again, so its
mapping goes once idle and it is found unlinked (checked every UNLINKED_CHECK_S), instead
of pinning its pages in /dev/shm. Where the kernel lacks PAGEMAP_SCAN (Linux < 6.7) or
RDT_SHM_KEEP_MAPS=0, nothing is kept: each fetch maps anew, as before.

Runs on: consumer (shm's views).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _io
from . import _segments
from ._segments import IdleSweep, idle_s, let_go_off_loop, oldest

MAX_IDLE_BYTES = 4 << 30  # address space and page tables only: the pages are the files'
UNLINKED_CHECK_S = 1.0  # how often idle mappings of files opened by name are checked for a name left


def _none_kept(tag: str) -> bool:
    return False


# Whether the newest idle mapping tagged `tag` (`MappingCache.open`) stays past the idle
# time: the node relay sets it (a subscription here follows that producer).
kept_tag: Callable[[str], bool] = _none_kept
_PAGE = mmap.PAGESIZE


@dataclasses.dataclass(eq=False)
class _Mapped:
    key: tuple[int, int, int]  # (st_dev, st_ino, st_size) of the file
    mm: mmap.mmap
    addr: int
    idle_since: float = 0.0
    tag: str = ""  # whose file it is (`open`), for `kept_tag`
    fd: int = -1  # of a file opened by name (`open`), to see whether it still has one

    def unlinked(self) -> bool:
        """Whether its file was opened by name and has none left now."""
        if self.fd < 0:
            return False
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True


class MappingCache:
    """Idle private mappings by file; `open` hands out a buffer over one. Thread-safe."""

    def __init__(self) -> None:
        self._start_empty()

    def _start_empty(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, int, int], _Mapped] = {}
        self._sweeper = IdleSweep(self._sweep)
        self.reused = 0  # fetches served by a kept mapping
        self.restored_pages = 0  # pages a consumer had written, dropped before a reuse

    def open(self, fd: int, hold: Any, tag: str = "", *, named: bool = False) -> Any:
        """A writable buffer over all of `fd`'s file, mapped copy-on-write; it keeps `hold`.

        Views made of it (`torch.frombuffer`) keep it alive; when the last goes, its
        mapping is kept for the next fetch of the file (past the idle time where `kept_tag(tag)`;
        `named`: `fd` was opened by the file's name, and the mapping goes once it has none).
        """
        idle_s()  # (a bad RDT_SHM_IDLE_S fails here, not when the last view goes)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size)
        _io.settle()  # mappings whose views went just now are idle again
        with self._lock:
            m = self._idle.pop(key, None)
        if m is not None:
            try:
                self.restored_pages += _restore(m.addr, st.st_size)
                self.reused += 1
            except OSError:
                _close(m)
                m = None
        if m is None:
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            m = _Mapped(key, mm, _address(mm))
            if named and _keeps():
                m.fd = os.dup(fd)
        m.tag = tag
        buf = (ctypes.c_char * st.st_size).from_buffer(m.mm)
        buf.hold = hold  # type: ignore[attr-defined]  # the object lives while a view does
        _io.finalize(buf, self._idle_again, m)
        return buf

    def _idle_again(self, m: _Mapped) -> None:
        """The last view of a fetch went (through `_io.finalize`): keep it, or let it go."""
        if not _keeps():  # the mapping goes with its last reference; its name's fd now
            _close_fd(m)
            return
        if m.unlinked():  # freed by its producer: no fetch can open it again
            let_go_off_loop(_close, [m])
            return
        m.idle_since = time.monotonic()
        with self._lock:
            old = self._idle.pop(m.key, None)  # one per file is enough
            self._idle[m.key] = m
            evicted = [old] if old is not None else []
            while sum(x.key[2] for x in self._idle.values()) > MAX_IDLE_BYTES:
                evicted.append(self._idle.pop(next(iter(self._idle))))  # the longest idle first
        for x in evicted:
            _close(x)
        self._sweeper.start(after=min(idle_s(), UNLINKED_CHECK_S) if m.fd >= 0 else None)

    def sweep_soon(self) -> None:
        """A tag is no longer kept (`kept_tag`): its mapping goes once idle as long as any other."""
        self._sweeper.start()

    def _spared(self) -> set[tuple[int, int, int]]:
        """The idle mappings kept past the idle time (under the lock): the newest of each kept tag."""
        newest: dict[str, _Mapped] = {}
        for m in self._idle.values():
            if m.tag and kept_tag(m.tag) and (m.tag not in newest or m.idle_since > newest[m.tag].idle_since):
                newest[m.tag] = m
        return {m.key for m in newest.values()}

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        with self._lock:
            spared = self._spared()
            old = [m for m in self._idle.values() if (m.idle_since <= cutoff and m.key not in spared) or m.unlinked()]
            for m in old:
                del self._idle[m.key]
            left = oldest(m for m in self._idle.values() if m.key not in spared)
            if any(m.fd >= 0 for m in self._idle.values()):  # look again for unlinked ones soon
                soon = time.monotonic() + UNLINKED_CHECK_S - idle_s()  # (as if one had gone idle then)
                left = soon if left is None else min(left, soon)
        let_go_off_loop(_close, old)
        return left

    def let_go_unlinked(self) -> int:
        """Unmap now the idle mappings of files unlinked since (a producer of this process
        short of room in /dev/shm: `_segments.room_makers`); return their bytes."""
        _io.settle()
        with self._lock:
            gone = [m for m in self._idle.values() if m.unlinked()]
            for m in gone:
                del self._idle[m.key]
        for m in gone:
            _close(m)
        return sum(m.key[2] for m in gone)

    def clear(self) -> None:
        _io.settle()  # mappings whose last view went just now are idle: those go too
        with self._lock:
            old, self._idle = list(self._idle.values()), {}
        for m in old:
            _close(m)

    def forked(self) -> None:
        """In a forked child: the idle mappings are copies of the parent's (they would keep
        the pages of files the parent's producers unlink), its sweeps run not here, and a
        lock may be held by a thread that is not here. Close the copies; start empty."""
        copies = list(self._idle.values())
        self._start_empty()
        for m in copies:
            _close(m)

    def stats(self) -> dict[str, int]:
        _io.settle()
        with self._lock:
            return {
                "idle": len(self._idle),
                "idle_bytes": sum(m.key[2] for m in self._idle.values()),
                "reused": self.reused,
                "restored_pages": self.restored_pages,
            }


def _address(mm: mmap.mmap) -> int:
    """Where `mm` starts in this process (no export of it is left behind)."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _close(m: _Mapped) -> None:
    try:
        m.mm.close()
    except BufferError:  # still exported somewhere: it is unmapped with its last reference
        pass
    _close_fd(m)


def _close_fd(m: _Mapped) -> None:
    fd, m.fd = m.fd, -1
    if fd >= 0:
        os.close(fd)


def _keeps() -> bool:
    return os.environ.get("RDT_SHM_KEEP_MAPS", "1") != "0" and _scan_supported()


# -- PAGEMAP_SCAN (linux/fs.h): the pages of a range the consumer has written -----------------


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
                     "category_inverted", "category_mask", "category_anyof_mask", "return_mask")
    ]


_PAGE_IS_FILE = 1 << 2
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)
_MADV_DONTNEED = 4
_REGIONS = 64


class _Kernel:
    """libc's ioctl and madvise, and this process's pagemap, opened once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.ioctl = libc.ioctl
        self.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self.pid = os.getpid()


_kernel: _Kernel | None = None
_supported: bool | None = None
_kernel_lock = threading.Lock()


def _get_kernel() -> _Kernel:
    global _kernel
    with _kernel_lock:
        if _kernel is None or _kernel.pid != os.getpid():
            _kernel = _Kernel()
        return _kernel


def _scan_supported() -> bool:
    """Whether PAGEMAP_SCAN works here (asked once, on a page of our own)."""
    global _supported
    if _supported is None:
        try:
            probe = mmap.mmap(-1, _PAGE)
            try:
                _written(_address(probe), _PAGE)
                _supported = True
            finally:
                probe.close()
        except (OSError, AttributeError):
            _supported = False
    return _supported


def _written(addr: int, size: int) -> list[tuple[int, int]]:
    """Address ranges in [addr, addr + size) whose pages are present and not the file's."""
    k = _get_kernel()
    vec = (_PageRegion * _REGIONS)()
    out: list[tuple[int, int]] = []
    start, end = addr, addr + size
    while start < end:
        arg = _ScanArg(
            size=ctypes.sizeof(_ScanArg), start=start, end=end, vec=ctypes.addressof(vec), vec_len=_REGIONS,
            # Not the file's page, and present or swapped out (a written page in swap is the
            # consumer's too: missed, it would come back after a reuse).
            category_inverted=_PAGE_IS_FILE, category_mask=_PAGE_IS_FILE,
            category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
            return_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED | _PAGE_IS_FILE,
        )
        n = k.ioctl(k.pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"PAGEMAP_SCAN: {os.strerror(err)}")
        out += [(vec[i].start, vec[i].end) for i in range(n)]
        if arg.walk_end <= start:
            break
        start = arg.walk_end
    return out


def _restore(addr: int, size: int) -> int:
    """Drop the consumer's own copies of pages in the range: the file shows there again."""
    k = _get_kernel()
    pages = 0
    for start, end in _written(addr, size):
        if k.madvise(start, end - start, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise: {os.strerror(err)}")
        pages += (end - start) // _PAGE
    return pages


cache = MappingCache()
_segments.room_makers.append(cache.let_go_unlinked)


def _forked() -> None:
    """A forked child starts with no kept mappings (see `MappingCache.forked`)."""
    global _kernel_lock
    _kernel_lock = threading.Lock()
    cache.forked()


os.register_at_fork(after_in_child=_forked)
