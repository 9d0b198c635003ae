"""Warm shared-memory segments for shm's copies, recycled once nobody can see them.

Fresh pages fault in slowly (0.3-2.6 GiB/s on small VMs, against ~10 GiB/s for a copy
into warm memory), so a producer returning a fresh tensor each step would pay first
touch every time. A segment whose object went away with its last ref goes back to this
pool -- consumers' views hold their object (see shm.py), so by then nobody maps it --
keeping its pages and the producer's mapping, and takes its new object's name on reuse
(`name_for`: an old name then finds nothing). An object freed explicitly (`rdt.free`) may still be
viewed: its segment is unlinked, never reused.

Bounded (MAX_BYTES in all, or two segments of the largest capacity recycled where those
are more) and shrinking: a segment unused for RDT_SHM_IDLE_S seconds (default 10) is
unlinked. Unless that is set, a capacity taken again and again is kept for up to twice
the time between its takes (at most KEEP_MAX_S): a trainer returning 1 GiB every 30 s
would otherwise fault a fresh segment in (~1 s here) at every step. Two of a size: a
producer returning one large tensor each step needs a second segment while a consumer
still holds the last one; with room for one, back-to-back returns of 1 GiB made a fresh
segment every other step here.
Capacities are powers of two from 1 MiB (tmpfs allocates only the pages written).
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import hashlib
import itertools
import math
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _io
from .._errors import TransferError

SHM_DIR = "/dev/shm"


def room() -> str:
    """How full /dev/shm is, for a message: "12 MiB free of 64 MiB"."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "its size unknown"
    return f"{st.f_bavail * st.f_frsize / (1 << 20):.0f} MiB free of {st.f_blocks * st.f_frsize / (1 << 20):.0f} MiB"


# What to do about a /dev/shm too small, said once for every message that says so.
MORE_ROOM = "give it more (Docker: `docker run --shm-size=...`; Kubernetes: an emptyDir volume with medium Memory at /dev/shm)"
PREFIX = "rdt-"
MIN_BYTES = 1 << 20
MAX_BYTES = 1 << 30  # the pool's idle segments, in all
NO_ROOM = (errno.ENOSPC, errno.ENOMEM)  # what making or growing a segment raises where SHM_DIR is full
ROOM_WAIT_S = 5.0  # the longest a take with no room waits for the unmapping of segments let go just before
# What else of this process's may hold room in SHM_DIR and can go at once: each call lets
# go of it and returns its bytes (the consumer's kept mappings of files unlinked since).
room_makers: list[Callable[[], int]] = []


IDLE_S = 10.0  # RDT_SHM_IDLE_S's default
_idle_read: tuple[str | None, float] = (None, IDLE_S)  # (RDT_SHM_IDLE_S as last read, its value)


def idle_s() -> float:
    """Seconds idle warm shared memory is kept: segments here, consumers' mappings, relay
    memfds (RDT_SHM_IDLE_S, default 10). Each value of the setting is parsed once.

    The pools read it before they take or make anything (`SegmentPool.take`,
    `MappingCache.open`, the relay's memfds), so that a bad value fails there, never
    halfway through letting something go.
    Raises: ValueError naming RDT_SHM_IDLE_S where it is not a number of seconds >= 0.
    """
    global _idle_read
    raw, (seen, value) = os.environ.get("RDT_SHM_IDLE_S"), _idle_read
    if raw == seen:
        return value
    if raw is None:
        value = IDLE_S
    else:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"RDT_SHM_IDLE_S={raw!r}: give the seconds idle warm shared memory is kept, a number >= 0 "
                f"(default {IDLE_S:g})"
            )
    _idle_read = (raw, value)
    return value


KEEP_MAX_S = 120.0  # the longest a segment taken at a slow, steady cadence is kept idle
MAX_KINDS = 1024  # the kinds a `Cadence` remembers at most (the relay's: one per capacity and producer)


class Cadence:
    """How often things of each kind are taken, so that one taken again and again stays
    warm between takes: `keep_s` is `idle_s()`, or where RDT_SHM_IDLE_S is not set, up to
    twice the time between the last two takes of its kind (KEEP_MAX_S at most). Not
    thread-safe: its owner's lock guards it.

    Bounded: a kind not taken for KEEP_MAX_S is forgotten (the keep it would earn ends
    before its next take), and past MAX_KINDS the least recently taken goes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._taken: dict[Any, float] = {}  # kind -> when one was last taken, the least recent first
        self._gap: dict[Any, float] = {}  # kind -> the time between its last two takes

    def taken(self, kind: Any) -> None:
        now = self._clock()
        last = self._taken.pop(kind, None)
        if last is not None:
            self._gap[kind] = now - last
        self._taken[kind] = now
        while True:  # (ends at `kind` at the latest: taken just now)
            old = next(iter(self._taken))
            if now - self._taken[old] <= KEEP_MAX_S and len(self._taken) <= MAX_KINDS:
                break
            del self._taken[old]
            self._gap.pop(old, None)

    def keep_s(self, kind: Any) -> float:
        idle = idle_s()
        if "RDT_SHM_IDLE_S" in os.environ:
            return idle
        return max(idle, min(KEEP_MAX_S, 2 * self._gap.get(kind, 0.0)))

    def idle_from(self, kind: Any) -> float:
        """When one of `kind` going idle now counts as idle to an `IdleSweep` of `idle_s()`:
        later by the grace its cadence gives it."""
        return self._clock() + self.keep_s(kind) - idle_s()


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
        self._due = 0.0  # when the pending sweep runs (time.monotonic())

    def start(self, after: float | None = None) -> None:
        """Something went idle (any thread): make sure a sweep comes within `after` seconds
        (default: `idle()`), sooner than a pending one where need be."""
        delay = self._idle() if after is None else after
        due = time.monotonic() + delay
        with self._lock:
            if self._pending and due >= self._due:
                return
            self._pending, self._due = True, due
        _io.call_soon(self._schedule, delay)

    def _schedule(self, delay: float) -> None:  # on the I/O loop
        import asyncio

        asyncio.get_running_loop().call_later(max(0.0, delay), self._run)

    def _run(self) -> None:  # on the I/O loop
        with self._lock:
            self._pending = False  # before the sweep: what goes idle during it starts another
        oldest = self._sweep(time.monotonic() - self._idle())
        if oldest is None:
            return
        due = oldest + self._idle()
        with self._lock:
            if self._pending and due >= self._due:
                return
            self._pending, self._due = True, due
        self._schedule(due - time.monotonic())


def let_go_off_loop(close: Callable[[Any], None], items: list[Any]) -> concurrent.futures.Future[None] | None:
    """Call `close` on each of `items` in the pool, not on the I/O loop where sweeps run:
    unmapping hundreds of MiB takes its thread 10-90 ms here (the GIL released), time the
    loop owes the transfers under way. Only for what this process alone holds (a mapping,
    a descriptor), never for a file that must be gone before the process exits. Returns
    the work's future (None: no items)."""
    if not items:
        return None
    try:
        return _io.pool(_io.CALLS).submit(_let_go, close, items)
    except RuntimeError:  # the interpreter is shutting down: no pool takes work now
        _let_go(close, items)
        return None


def _let_go(close: Callable[[Any], None], items: list[Any]) -> None:
    for item in items:
        close(item)


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


# A segment's name: `rdt-<pid>-<pid namespace>-<24 hex>`, the hex a keyed hash of its object's
# id (see `name_for`). Anything else under /dev/shm is not a segment a consumer may open.
SEGMENT_NAME = re.compile(r"rdt-([1-9][0-9]{0,9})-([0-9]{1,20})-([0-9a-f]{24})")
KEY = re.compile(r"[0-9a-f]{32}")


def new_key() -> str:
    """A fresh per-object secret for `name_for` (128 random bits, hex)."""
    return secrets.token_hex(16)


def name_for(
    obj_id: str, key: str, size: int, layout: Sequence[tuple[int, int]] = (), pid: int | None = None, ns: str | None = None
) -> str:
    """The name process `pid` (of PID namespace `ns`; default: this process) gives the
    segment of object `obj_id` whose metadata carries `key` and `size` (its bytes), with its
    tensors at `layout` (offset and bytes of each that has any, in order).

    Bound to the object, its size, layout and secret: a consumer recomputes it from the
    ref, so a ref opens only its own object's segment, and reads no byte past the object's
    own (a reused segment's tail holds an earlier object's bytes: a ref that claimed more
    would read them), nor a tensor of other bytes than its own (a spec that claims fewer
    would return a prefix). The listing of /dev/shm shows names, not keys, and a name
    cannot be made from another object's id, size or key.
    """
    flat = np.fromiter(itertools.chain.from_iterable(layout), dtype=np.int64, count=2 * len(layout))
    what = f"{obj_id}\0{size}\0".encode("utf-8", "surrogatepass") + flat.tobytes()
    digest = hashlib.blake2b(what, key=bytes.fromhex(key), digest_size=12)
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{pid_namespace() if ns is None else ns}-{digest.hexdigest()}"


_dir: tuple[int, int, int] | None = None  # (pid, fd of SHM_DIR, its st_dev), opened once per process
_dir_lock = threading.Lock()


def shm_dir() -> tuple[int, int]:
    """An fd of SHM_DIR (opened once per process) and its device."""
    global _dir
    d = _dir
    if d is not None and d[0] == os.getpid():
        return d[1], d[2]
    with _dir_lock:
        if _dir is None or _dir[0] != os.getpid():
            fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            _dir = (os.getpid(), fd, os.fstat(fd).st_dev)
        return _dir[1], _dir[2]


def open_own(name: str, min_size: int, what: str, obj_id: str | None = None) -> int:
    """Open `name` in SHM_DIR read-only, if it is a file a producer of ours made; return its fd.

    Never follows a link, never waits (a FIFO), and refuses all but a regular file of this
    user, on SHM_DIR's file system, with one name and at least `min_size` bytes. `name`
    must have been checked to be a plain name of our format already.
    Raises: FileNotFoundError; TransferError naming `what` and why it was refused.
    """
    dir_fd, dev = shm_dir()
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP (a symbolic link), EACCES (another user's), ...
        raise TransferError(f"{what}: refused {SHM_DIR}/{name}: {exc.strerror or exc}", obj_id=obj_id) from exc
    try:
        check_file(os.fstat(fd), dev, links=1, min_size=min_size, what=f"{what}: refused {SHM_DIR}/{name}", obj_id=obj_id)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(st: os.stat_result, dev: int, *, links: int, min_size: int, what: str, obj_id: str | None = None) -> None:
    """Refuse a file that is not a regular one of this user on SHM_DIR's file system with
    `links` names and at least `min_size` bytes.

    Raises: TransferError starting with `what`.
    """
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_dev != dev:
        why = f"it is not on the file system of {SHM_DIR}"
    elif st.st_uid != os.geteuid():
        why = f"it belongs to uid {st.st_uid}, not to this process's {os.geteuid()}"
    elif st.st_nlink != links:
        why = f"it has {st.st_nlink} name(s), where a producer's file has {links}"
    elif st.st_size < min_size:
        why = f"it holds {st.st_size} bytes, fewer than the {min_size} its metadata claims"
    else:
        return
    raise TransferError(f"{what}: {why}", obj_id=obj_id)


def _capacity(nbytes: int) -> int:
    return max(MIN_BYTES, 1 << (nbytes - 1).bit_length())


class SegmentPool:
    """Segments in use (by name) and idle ones, by capacity. Thread-safe."""

    def __init__(self) -> None:
        self._start_empty()

    def _start_empty(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._used: dict[str, Segment] = {}
        self._sweeper = IdleSweep(self._sweep, lambda: idle_s())
        self.created = 0  # segments made (not reused) and handed out so far
        self._cadence = Cadence()  # of each capacity
        self._unmapping: set[concurrent.futures.Future[None]] = set()  # segments let go, their mappings still to close

    def keep_s(self, capacity: int) -> float:
        """How long an idle segment of `capacity` is kept: `idle_s()`, or where RDT_SHM_IDLE_S
        is not set, up to twice the time between takes of that capacity (KEEP_MAX_S at most)."""
        with self._lock:
            return self._cadence.keep_s(capacity)

    def take(self, nbytes: int, name: str) -> Segment:
        """A segment of at least `nbytes` named `name` (`name_for`): an idle one of the right
        capacity, renamed, else a new one.

        Where /dev/shm has no room for it (the idle segments may hold it), lets go of every
        idle segment and tries once more.
        Raises: OSError (ENOSPC, ENOMEM: saying what was let go of first where it did).
        """
        capacity = _capacity(nbytes)
        idle_s()  # (a bad RDT_SHM_IDLE_S fails here, not when the segment is let go)
        with self._lock:
            self._cadence.taken(capacity)
        try:
            return self._take(nbytes, capacity, name)
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise
            freed = self.make_room()
            if freed is None:
                raise
        try:
            return self._take(nbytes, capacity, name)
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise
            raise OSError(
                exc.errno, f"{exc.strerror} (after letting go of {freed / (1 << 20):.1f} MiB of idle warm shared memory)"
            ) from exc

    def make_room(self) -> int | None:
        """Let go of every idle segment now (and what `room_makers` let go of), and wait
        (ROOM_WAIT_S at most) until those let go before are unmapped: their pages are free
        once no process maps them. Returns the idle bytes let go of; None where nothing
        was idle or being unmapped, or where the caller is an event loop (which never
        waits: the segments are let go in the pool, for the next take)."""
        with self._lock:
            idle, self._idle = self._idle, []
            unmapping = list(self._unmapping)
        if _io.running_loop() is not None:
            # On an event loop (an async producer prepares small objects inline) nothing
            # waits: the idle segments go in the pool, and this take fails as it would
            # have (its caller falls back); the next finds the room (`room_makers`, which
            # unmap in the caller's thread, are left to their own sweeps).
            self._retire(idle)
            return None
        for seg in idle:
            _drop(seg)
        freed = sum(s.capacity for s in idle) + sum(make() for make in room_makers)
        if not freed and not unmapping:
            return None
        concurrent.futures.wait(unmapping, timeout=ROOM_WAIT_S)
        return freed

    def _take(self, nbytes: int, capacity: int, name: str) -> Segment:
        with self._lock:
            seg = next((s for s in self._idle if s.capacity == capacity), None)
            if seg is not None:
                self._idle.remove(seg)
        if seg is not None:
            try:
                os.rename(seg.path, os.path.join(SHM_DIR, name))  # same pages, same mapping: a name nobody holds
            except OSError:  # someone unlinked it (a hand, a tmp cleaner), or worse: let it go, make another
                _drop(seg)  # (under its old name)
                seg = None
            else:
                seg.name = name
        made = seg is None
        if seg is None:
            seg = self._create(capacity, name)
        if seg.reserved < nbytes:
            try:
                _reserve(seg, nbytes)
            except BaseException:
                _drop(seg)
                raise
        with self._lock:
            self._used[seg.name] = seg
            self.created += made
        return seg

    def _create(self, capacity: int, name: str) -> Segment:
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
        idle = idle_s()  # (first: a bad setting raises before the segment leaves `_used`)
        with self._lock:
            seg = self._used.pop(name, None)
            if seg is None:
                return
            seg.idle_since = self._cadence.idle_from(seg.capacity)  # (the sweeper drops what is idle `idle_s()`)
            grace = max(0.0, seg.idle_since - time.monotonic())
            self._idle.append(seg)
            evicted = []
            bound = max(MAX_BYTES, 2 * seg.capacity)
            while sum(s.capacity for s in self._idle) > bound:
                evicted.append(self._idle.pop(0))  # the longest idle first
        self._retire(evicted)
        self._sweeper.start(after=idle + grace)

    def discard(self, name: str) -> None:
        """Its object was freed while views may remain: unlink it, never reuse it."""
        with self._lock:
            seg = self._used.pop(name, None)
        if seg is not None:
            self._retire([seg])
        elif owner(name) == (os.getpid(), pid_namespace()):  # (a forked child's copy of the parent's: not its own)
            _unlink(os.path.join(SHM_DIR, name))

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        with self._lock:
            old = [s for s in self._idle if s.idle_since <= cutoff]
            self._idle = [s for s in self._idle if s.idle_since > cutoff]
            left = oldest(self._idle)
        self._retire(old)
        return left

    def _retire(self, segs: list[Segment]) -> None:
        """`_drop` `segs` where the I/O loop may be the caller: each file is unlinked now (it
        must be gone before this process exits), the mappings are closed in the pool
        (`let_go_off_loop`: 20 ms per 256 MiB here)."""
        for seg in segs:
            _unlink(seg.path)
        work = let_go_off_loop(_unmap, segs)
        if work is not None:
            with self._lock:
                self._unmapping.add(work)
            work.add_done_callback(self._unmapped)

    def _unmapped(self, work: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._unmapping.discard(work)

    def forked(self) -> None:
        """In a forked child: the segments are the parent's (this process has copies of its
        mappings, which would keep their pages after the parent unlinks them), its sweeps
        run not here, and a lock may be held by a thread that is not here. Close the copies
        (never unlink: the files are the parent's) and start empty."""
        copies = self._idle + list(self._used.values())
        self._start_empty()
        for seg in copies:
            _unmap(seg)

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
    _unmap(seg)
    _unlink(seg.path)


def _unmap(seg: Segment) -> None:
    try:
        seg.mm.close()
    except BufferError:  # a view of it is still alive here: the mapping goes with it
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


pool = SegmentPool()


def _forked() -> None:
    """A forked child starts with no segments of its own (see `SegmentPool.forked`)."""
    global _dir_lock
    _dir_lock = threading.Lock()
    pool.forked()


os.register_at_fork(after_in_child=_forked)
