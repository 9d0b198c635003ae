"""Warm shared-memory segments for shm's copies, recycled once nobody can see them.

Fresh pages fault in slowly (0.3-2.6 GiB/s on small VMs, against ~10 GiB/s for a copy
into warm memory), so a producer returning a fresh tensor each step would pay first
touch every time. A segment whose object went away with its last ref goes back to this
pool -- consumers' views hold their object (see shm.py), so by then nobody maps it --
keeping its pages and the producer's mapping, and takes a new random name on reuse (an
old name then finds nothing). An object freed explicitly (`rdt.free`) may still be
viewed: its segment is unlinked, never reused.

Bounded (MAX_BYTES in all) and shrinking: a segment unused for RDT_SHM_IDLE_S seconds
(default 10) is unlinked.
Capacities are powers of two from 1 MiB (tmpfs allocates only the pages written).
"""

from __future__ import annotations

import functools
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import _io

SHM_DIR = "/dev/shm"
PREFIX = "rdt-"
MIN_BYTES = 1 << 20
MAX_BYTES = 1 << 30  # the pool's idle segments, in all


def idle_s() -> float:
    """Seconds idle warm shared memory is kept: segments here, consumers' mappings, relay
    memfds (RDT_SHM_IDLE_S, default 10)."""
    return float(os.environ.get("RDT_SHM_IDLE_S", "10"))


class IdleSweep:
    """Calls `sweep(cutoff)` on the I/O loop `idle()` seconds after `start()`, and again
    while anything is left idle, when the oldest of it has been idle `idle()`. `sweep` lets
    go of what has been idle since `cutoff` (a `time.monotonic()`) or before, and returns
    when the oldest of the rest went idle (None: nothing is). So nothing stays idle much
    longer than `idle()` (default: `idle_s()`, for warm shared memory). Thread-safe."""

    def __init__(self, sweep: Callable[[float], float | None], idle: Callable[[], float] = idle_s) -> None:
        self._sweep = sweep
        self._idle = idle
        self._lock = threading.Lock()
        self._pending = False

    def start(self) -> None:
        """Something went idle (any thread): make sure a sweep is coming."""
        with self._lock:
            if self._pending:
                return
            self._pending = True
        _io.call_soon(self._schedule, self._idle())

    def _schedule(self, delay: float) -> None:  # on the I/O loop
        import asyncio

        asyncio.get_running_loop().call_later(max(0.0, delay), self._run)

    def _run(self) -> None:  # on the I/O loop
        with self._lock:
            self._pending = False  # before the sweep: what goes idle during it starts another
        oldest = self._sweep(time.monotonic() - self._idle())
        if oldest is None:
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        self._schedule(oldest + self._idle() - time.monotonic())


def oldest(items: Iterable[Any]) -> float | None:
    """When the longest idle of `items` (each with `idle_since`) went idle; None for none."""
    return min((x.idle_since for x in items), default=None)


@dataclass
class Segment:
    name: str
    capacity: int
    mm: mmap.mmap = field(repr=False)  # the producer's warm MAP_SHARED mapping
    idle_since: float = 0.0
    reserved: int = 0  # bytes from the start that tmpfs has given pages to (posix_fallocate)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str:
    """This process's PID namespace (its inode): with it in our files' names, a producer's
    guardian judges only files of its own namespace by their pid. Containers that share
    /dev/shm (`--ipc=host`) but not PIDs see each other's pids as dead (or as others).
    Read once: a process never changes its own PID namespace (setns and unshare of one
    move only the children it makes afterwards), so neither does a fork."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def name_prefix() -> str:
    """`rdt-<pid>-<pid namespace>-`: what every file this process makes under /dev/shm starts with."""
    return f"{PREFIX}{os.getpid()}-{pid_namespace()}-"


def owner(name: str) -> tuple[int, str] | None:
    """The (pid, pid namespace) a file of ours was made by; None for a name not of ours."""
    parts = name[len(PREFIX) :].split("-", 2) if name.startswith(PREFIX) else []
    if len(parts) < 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def _new_name() -> str:
    return f"{name_prefix()}{secrets.token_hex(12)}"


def _capacity(nbytes: int) -> int:
    return max(MIN_BYTES, 1 << (nbytes - 1).bit_length())


class SegmentPool:
    """Segments in use (by name) and idle ones, by capacity. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._used: dict[str, Segment] = {}
        self._sweeper = IdleSweep(self._sweep)
        self.created = 0  # segments made (not reused) so far

    def take(self, nbytes: int) -> Segment:
        """A segment of at least `nbytes`: an idle one of the right capacity, else a new one."""
        capacity = _capacity(nbytes)
        with self._lock:
            seg = next((s for s in self._idle if s.capacity == capacity), None)
            if seg is not None:
                self._idle.remove(seg)
        if seg is not None:
            old = seg.path
            seg.name = _new_name()
            try:
                os.rename(old, seg.path)  # same pages, same mapping: a name nobody holds
            except FileNotFoundError:  # someone unlinked it (a hand, a tmp cleaner): make another
                _drop(seg)
                seg = None
        if seg is None:
            seg = self._create(capacity)
            self.created += 1
        if seg.reserved < nbytes:
            try:
                _reserve(seg, nbytes)
            except BaseException:
                _drop(seg)
                raise
        with self._lock:
            self._used[seg.name] = seg
        return seg

    def _create(self, capacity: int) -> Segment:
        name = _new_name()
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return Segment(name, capacity, mm)

    def recycle(self, name: str) -> None:
        """Its object went with its last ref (so every view): keep it warm for the next copy."""
        with self._lock:
            seg = self._used.pop(name, None)
            if seg is None:
                return
            seg.idle_since = time.monotonic()
            self._idle.append(seg)
            evicted = []
            while sum(s.capacity for s in self._idle) > MAX_BYTES:
                evicted.append(self._idle.pop(0))  # the longest idle first
        for old in evicted:
            _drop(old)
        self._sweeper.start()

    def discard(self, name: str) -> None:
        """Its object was freed while views may remain: unlink it, never reuse it."""
        with self._lock:
            seg = self._used.pop(name, None)
        if seg is not None:
            _drop(seg)
        else:
            _unlink(os.path.join(SHM_DIR, name))

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        with self._lock:
            old = [s for s in self._idle if s.idle_since <= cutoff]
            self._idle = [s for s in self._idle if s.idle_since > cutoff]
            left = oldest(self._idle)
        for seg in old:
            _drop(seg)
        return left

    def stats(self) -> dict[str, int]:
        with self._lock:
            idle_bytes = sum(s.capacity for s in self._idle)
            return {"idle": len(self._idle), "idle_bytes": idle_bytes, "used": len(self._used), "created": self.created}


def _reserve(seg: Segment, nbytes: int) -> None:
    """Have tmpfs give the segment its pages now: a full /dev/shm raises OSError (ENOSPC)
    here, where a write into a page it cannot give would kill the process (SIGBUS)."""
    fd = os.open(seg.path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    seg.reserved = nbytes


def _drop(seg: Segment) -> None:
    try:
        seg.mm.close()
    except BufferError:  # a view of it is still alive here: the mapping goes with it
        pass
    _unlink(seg.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


pool = SegmentPool()
