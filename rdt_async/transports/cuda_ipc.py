"""`cuda_ipc`: one-sided reads of CUDA tensors between processes of one node, through CUDA IPC.

Producer: `prepare` takes the IPC handle of the allocation under each tensor (the
caching allocator's segment: `cuIpcGetMemHandle`, no copy) and a liveness slot in a
small table under /dev/shm that holds a random token while the object lives, and a
digest of the object's id and exports (handle, offset, length, device).
Non-contiguous tensors are copied once to a contiguous tensor kept with the object.
torch's own `_share_cuda_` is not used: it expects exactly one release per export, made
by the one consumer that maps it, and an object here is read by any number of fetches.

Consumer: checks the slot (the token, and the digest of the ref's exports: a ref altered to
read elsewhere in an allocation, or another object's handle, is refused before anything
is mapped), maps the segment (`cuIpcOpenMemHandle`, no copy; mapped once
per process and kept while fetches use it, closed MAP_IDLE_S after the last), copies
device-to-device into fresh memory or the caller's `into=` buffers on a copy stream of
its own, waits for the copy's CUDA event on the caller's own loop (asleep for most of
the copy's expected time, then polled between the loop's other work), then reads the
slot again: a token that changed means the object was freed during the read and the
fetch raises ObjectFreedError instead of returning bytes the producer's allocator may
have handed to other tensors. A cancelled fetch returns once its copy has landed (a GPU
copy cannot be recalled), so nothing writes the caller's buffers later.

Freeing: `garbage_collect` clears the slot at once and drops the producer's reference
to the tensors after a linger (LINGER_S plus the time to read them at 10 GB/s, and past
the time a consumer keeps a mapping idle: MAP_IDLE_S). A copy racing an explicit
`free()` mostly reads the object's own bytes, but one that runs past the linger (a busy
pool, a busy GPU) may read memory the producer's allocator has handed to other tensors:
the slot's second read fails it then (ObjectFreedError), and `into=` buffers it wrote
hold no valid value (the error says so).

Reach: the producer's node only, and a GPU the consumer's CUDA context can map: the
producer's GPU (found by UUID, whatever CUDA_VISIBLE_DEVICES numbers it) or one with
peer access to it. CUDA IPC does not work on MIG instances. Where it cannot work, the
error says so and names `nixl`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import mmap
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import _cuda, _io
from .._errors import ObjectFreedError, PeerDiedError, RDTError, TransferError, TransportUnavailableError
from .._local import pid_alive
from . import _cudadrv, _segments, shm
from ._base import MAX_SPEC_BYTES, Channel, Cost, TransferInfo, Transport
from ._kit import digest, or_none

SLOTS_PER_TABLE = 1024
SLOT_WORDS = 2  # a slot's int64 words: the token, then the digest of the exports
TABLE_BYTES = SLOTS_PER_TABLE * SLOT_WORDS * 8
TOKEN_END = 1 << 62  # tokens are 1 .. TOKEN_END
# A liveness table's name: `rdt-<pid>-<pid namespace>-ipc-<16 hex>` (`_take_slot`).
TABLE_NAME = re.compile(r"rdt-([1-9][0-9]{0,9})-([0-9]{1,20})-ipc-[0-9a-f]{16}")
TABLE_CACHE = 64  # liveness tables a consumer keeps mapped (one per producer, mostly)
# A consumer closes a mapped segment MAP_IDLE_S after the last fetch using it ends; a
# producer keeps a freed object's tensors LINGER_S plus their bytes at LINGER_BYTES_PER_S.
# The producer's hold outlasts the consumer's: a fetch that checked the slot just before
# the free still maps and copies, and its mapping stays MAP_IDLE_S after; once no tensor of
# a segment is held, the caching allocator may cudaFree it (empty_cache(), or an allocation
# that does not fit otherwise), and freeing memory another process still maps is undefined
# (CUDA's cuIpcOpenMemHandle). The idle keep is short so that the hold is: a burst of
# fetches of one segment still maps it once.
MAP_IDLE_S = 0.1
# (The margin covers the sweep's turn on the I/O loop and the close's wait in the pool.)
LINGER_S, LINGER_BYTES_PER_S = MAP_IDLE_S + 0.4, 10e9
# A device copy's pace until one has been timed here (H100: ~1.5 TB/s, H200: ~2.1): the
# loop sleeps for most of a copy's expected time first. Copies from PACE_BYTES on are timed
# by the device, and the fastest pace seen rules after (a sleep past the copy's end is lost:
# at a fixed 1.6 TB/s an H200's 4 GiB copy was waited for 0.4 ms too long).
COPY_BYTES_PER_S = 1.6e12
PACE_BYTES = 16 << 20
# The loop sleeps until this long before a copy's expected end (its timers fire up to ~1 ms
# late), then polls it closely until CLOSE_S past that end; a copy still running then (a
# GPU busy with other work) is waited for in the pool.
WAKE_EARLY_S, CLOSE_S = 1.5e-3, 2e-3
# The CUresults of a mapping that cannot work between these two GPUs (or with CUDA IPC
# here at all): CUDA_ERROR_INVALID_DEVICE, _PEER_ACCESS_UNSUPPORTED, _PEER_ACCESS_NOT_ENABLED,
# _TOO_MANY_PEERS, _NOT_SUPPORTED. Any other failure is this fetch's, not the path's.
UNMAPPABLE = frozenset({101, 217, 705, 711, 801})

log = logging.getLogger("rdt_async")


@dataclass(frozen=True)
class IpcTensor:
    """One tensor as a consumer maps it: its segment's IPC handle and where it lies in it."""

    device_uuid: str
    handle: bytes  # cuIpcGetMemHandle of the allocation (64 bytes)
    offset: int  # bytes from the allocation's base
    nbytes: int


@dataclass(frozen=True)
class CudaIpcMeta:
    """What a consumer on the producer's node needs: the exports and the liveness slot."""

    host: str
    pid: int
    tensors: tuple[IpcTensor | None, ...]  # None for an empty tensor
    table: str  # name of the liveness table under /dev/shm
    slot: int
    token: int


@functools.cache
def _host() -> str:
    """This node's identity: host name and boot id (containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@functools.cache
def _uuids() -> dict[str, int]:
    """Return the UUID of each CUDA device this process sees -> its index here."""
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def _uuid(index: int) -> str:
    return next(u for u, i in _uuids().items() if i == index)


class _Table:
    """A liveness table: SLOTS_PER_TABLE slots of SLOT_WORDS int64 words in a file under /dev/shm."""

    def __init__(self, name: str, *, create: bool) -> None:
        """Make table `name` (producer), or open a producer's (consumer: `name` checked against
        TABLE_NAME first; opened by `_segments.open_own`, never through a link).

        Raises: FileNotFoundError; TransferError (consumer) if it is not a producer's table.
        """
        self.name = name
        if create:
            fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = _segments.open_own(name, TABLE_BYTES, "cuda_ipc fetch: liveness table")
        try:
            if create:
                os.ftruncate(fd, TABLE_BYTES)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._mm = mmap.mmap(fd, TABLE_BYTES, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        if create:
            os.close(fd)
            fd = -1
        self._fd = fd  # (a consumer's: kept, to tell that the producer's guardian unlinked it)
        # (A table evicted from a consumer's cache goes when no fetch holds it any more:
        # its mapping with it, its fd by this.)
        self._fd_closer = weakref.finalize(self, os.close, fd) if fd >= 0 else None
        self.words = memoryview(self._mm).cast("q")

    def token(self, slot: int) -> int:
        return int(self.words[SLOT_WORDS * slot])

    def bound(self, slot: int) -> int:
        """The digest of the exports of the object that holds `slot`."""
        return int(self.words[SLOT_WORDS * slot + 1])

    def unlinked(self) -> bool:
        """Whether the table's file has no name left (consumer): its producer ended."""
        return os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        self.words.release()
        self._mm.close()
        self._fd = -1
        if self._fd_closer is not None:
            self._fd_closer()  # (once)


class CudaIpcTransport(Transport[CudaIpcMeta]):
    """CUDA tensors between processes of one node: IPC-mapped, then one device copy."""

    name = "cuda_ipc"
    devices = ("cuda",)
    one_sided = True
    reach = "node"
    auto_prepares = True  # auto's GPU path on the producer's node (where exports_here)
    # Fitted to `python -m rdt_async.bench.gpu` fetches (fresh tensors, 64 MiB-4 GiB, two
    # processes on one H200, two runs on two machines of 2026-11-27, averaged; no Ray).
    auto_costs: ClassVar[Mapping[str, Cost]] = {"gpu/node": Cost(0.0003, 1830.0)}
    inline_prepare_bytes = 1 << 62  # an export copies nothing: never worth a thread hop
    receives_on_caller_loop = True  # it queues device copies and polls them

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards everything below
        self._tables: list[_Table] = []  # the producer's liveness tables
        self._free_slots: list[int] = []
        self._objects: dict[str, tuple[int, list[torch.Tensor]]] = {}  # obj_id -> slot, what it reads
        self._mapped: OrderedDict[str, _Table] = OrderedDict()  # the consumer's view of producers' tables
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pace = 0.0  # bytes/s of the fastest device copy timed here (0: none yet)

    @classmethod
    def exports_here(cls) -> bool:
        """Say whether this process's tensors can be exported: CUDA, and cudaMalloc'd memory.

        PyTorch's expandable segments and cudaMallocAsync allocate memory that CUDA IPC
        handles cannot export (`auto` then leaves it to nixl).
        """
        if CudaIpcTransport.unavailable_reason() is not None:
            return False
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        return "expandable_segments:true" not in conf.replace(" ", "").lower() and torch.cuda.get_allocator_backend() == "native"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device in this process (torch.cuda.is_available() is False)"
        if not os.path.isdir(shm.SHM_DIR):
            return f"{shm.SHM_DIR} does not exist (cuda_ipc keeps its liveness table there: Linux only)"
        mig = _mig_reason()
        if mig:
            return mig
        return None

    # -- producer --------------------------------------------------------------------

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> CudaIpcMeta:
        out: list[IpcTensor | None] = []
        kept: list[torch.Tensor] = []
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                out.append(None)
                continue
            if not t.is_contiguous():
                t = t.contiguous()
                _cuda.settle([t])  # consumers read it outside this thread's streams
            kept.append(t)
            out.append(_export(t, nbytes))
        table, slot, token = self._take_slot(digest(obj_id, out))
        with self._lock:
            self._objects[obj_id] = (slot, kept)
        return CudaIpcMeta(_host(), os.getpid(), tuple(out), table, slot, token)

    def garbage_collect(self, obj_id: str, meta: CudaIpcMeta) -> None:
        with self._lock:
            held = self._objects.pop(obj_id, None)
            if held is None:
                return
            slot, kept = held
            self._tables[slot // SLOTS_PER_TABLE].words[SLOT_WORDS * (slot % SLOTS_PER_TABLE)] = 0  # later reads fail
            self._free_slots.append(slot)
        # A copy that checked the slot just before may still read: keep the memory a while.
        linger = LINGER_S + sum(t.numel() * t.element_size() for t in kept) / LINGER_BYTES_PER_S
        _io.call_soon(_keep_for, kept, linger)

    def _take_slot(self, bound: int) -> tuple[str, int, int]:
        """Hold a slot for a new object whose exports' `digest` is `bound`: return its table's
        name, the slot and its token."""
        with self._lock:
            if not self._free_slots:
                n = len(self._tables)
                shm.ensure_guardian()  # removes the tables if this process is killed
                name = f"{_segments.name_prefix()}ipc-{secrets.token_hex(8)}"
                self._tables.append(_Table(name, create=True))
                self._free_slots = list(range((n + 1) * SLOTS_PER_TABLE - 1, n * SLOTS_PER_TABLE - 1, -1))
            slot = self._free_slots.pop()
            table = self._tables[slot // SLOTS_PER_TABLE]
            token = secrets.randbelow(TOKEN_END) + 1
            i = SLOT_WORDS * (slot % SLOTS_PER_TABLE)
            table.words[i + 1] = bound  # (first: a reader that sees the token sees it)
            table.words[i] = token
        return table.name, slot % SLOTS_PER_TABLE, token

    # -- consumer --------------------------------------------------------------------

    async def receive(
        self, info: TransferInfo[CudaIpcMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        meta = _checked(info)
        self._check_live(info)
        read = [m for m in meta.tensors if m is not None]
        with _mappings.using(read) as use:
            if read:
                try:
                    await use.mapped()
                except _MapFailed as exc:
                    self._check_live(info, during=True)  # a producer that ended or freed it: that is why
                    raise exc.error(info.obj_id) from exc.__cause__
            # A fresh tensor lands on the device its segment is mapped on (one device copy):
            # the mapping's, shared by every fetch of it, whatever this thread's device is.
            devices = iter(use.devices)
            out = []
            for b, s, m in zip(or_none(buffers, len(info.specs)), info.specs, meta.tensors):
                device = next(devices) if m is not None else torch.device("cuda")
                out.append(b if b is not None else torch.empty(s.shape, dtype=s.dtype, device=device))
            pairs = [(o, m) for o, m in zip(out, meta.tensors) if m is not None]
            if not pairs:
                return out
            if any(o.device.type != "cuda" or not o.is_contiguous() for o, _ in pairs):
                # Into CPU (or strided) buffers: a blocking copy, off the loop.
                await _io.to_thread_finished(_copy_blocking, pairs, use.sources)
            else:
                await self._queue_and_wait(pairs, use.sources)
        self._check_live(info, during=True, into=buffers is not None)
        return out

    async def _queue_and_wait(self, pairs: list[tuple[torch.Tensor, IpcTensor]], sources: list[torch.Tensor]) -> None:
        """Queue the copies on this process's copy stream and wait until they have landed."""
        events = []
        nbytes = sum(m.nbytes for _, m in pairs)
        devices = {o.device for o, _ in pairs}
        timed = nbytes >= PACE_BYTES and len(devices) == 1
        begun = torch.cuda.Event(enable_timing=True) if timed else None
        for device in devices:
            stream = self._stream(device)
            # Fresh memory may still be in use by work queued on this thread's stream.
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                if begun is not None:
                    begun.record(stream)
                for (o, _), src in zip(pairs, sources):
                    if o.device == device:
                        o.view(-1).view(torch.uint8).copy_(src, non_blocking=True)
                event = torch.cuda.Event(enable_timing=timed)
                event.record(stream)
                events.append(event)
        # Waited for on this loop (the caller's: `receives_on_caller_loop`): asleep until
        # shortly before the copy's expected end, then polled between the loop's other work.
        # Not with loop sleeps alone (those under 1 ms last 1 ms: a 1 GiB copy doubled), a
        # blocking-sync event (its wake-up cost 0.5 ms) or a hop to the pool (~0.3 ms there
        # and back). A cancel still waits for the copy to land (it cannot be recalled):
        # nothing writes the caller's buffers afterwards.
        ends = time.perf_counter() + nbytes / (self._pace or COPY_BYTES_PER_S)
        try:
            await _wait_landed(events, ends)
        except asyncio.CancelledError:
            await _io.to_thread_finished(_wait_copy, events, ends)
            raise
        if begun is not None:
            took_s = begun.elapsed_time(events[0]) / 1e3
            if took_s > 0:
                self._pace = max(self._pace, nbytes / took_s)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(index)
        return stream

    def _check_live(self, info: TransferInfo[CudaIpcMeta], *, during: bool = False, into: bool = False) -> None:
        """Raise unless the producer is reachable from here, alive, and holds the object
        (and, `during` False, exported for it what the ref says). `into`: the read wrote
        the caller's buffers (a failure says they hold no valid value).

        Raises: TransportUnavailableError (another node; its table not in this SHM_DIR),
        PeerDiedError, ObjectFreedError, TransferError (an altered ref).
        """
        meta = info.meta
        if meta.host != _host():
            raise TransportUnavailableError(
                f"cuda_ipc fetch of {info.obj_id}: the producer (pid {meta.pid}) is on another node "
                f"({meta.host.split('/')[0]}); CUDA IPC reaches one node only: use tensor_transport='nixl' or 'auto'",
                obj_id=info.obj_id,
            )
        table = self._live_table(info)
        if table.token(meta.slot) != meta.token:
            raise _freed(info, during, into)
        if not during:
            bound = table.bound(meta.slot)
            if table.token(meta.slot) != meta.token:  # freed (and the slot taken again) between the reads
                raise _freed(info, during)
            if bound != digest(info.obj_id, meta.tensors):
                raise TransferError(
                    f"cuda_ipc fetch of {info.obj_id}: its ref's exports are not the ones its producer made for it "
                    "(the ref was altered); nothing was mapped or read",
                    obj_id=info.obj_id,
                )

    def _live_table(self, info: TransferInfo[CudaIpcMeta]) -> _Table:
        """The producer's liveness table, once its producer is known not to have died.

        Its pid is judged only within its own PID namespace (the table's name holds it, as
        every file a producer makes): containers that share /dev/shm but not PIDs see each
        other's pids as dead, or as other processes. A producer of another namespace is
        judged by its table, which its guardian unlinks when it ends.
        Raises: PeerDiedError, TransportUnavailableError (its table is not in this SHM_DIR).
        """
        meta, obj_id = info.meta, info.obj_id
        made_by = _segments.owner(meta.table)
        ours = made_by is not None and made_by[1] == _segments.pid_namespace()
        died = f"cuda_ipc fetch of {obj_id}: the producer (pid {meta.pid}) died"
        if ours and not pid_alive(meta.pid):
            raise PeerDiedError(died, obj_id=obj_id)
        try:
            table = self._table(meta.table)
        except FileNotFoundError:
            if ours and not pid_alive(meta.pid):  # died since (its guardian unlinked the table)
                raise PeerDiedError(died, obj_id=obj_id) from None
            whose = (
                f"the producer (pid {meta.pid}) is alive but"
                if ours
                else f"the producer (pid {meta.pid} of another PID namespace, whose life this process cannot see) "
                "died, or"
            )
            raise TransportUnavailableError(
                f"cuda_ipc fetch of {obj_id}: its liveness table {shm.SHM_DIR}/{meta.table} is not here: {whose} "
                f"this process does not share the producer's {shm.SHM_DIR} (a container with one of its own: "
                "run both with the host's IPC namespace, e.g. docker --ipc=host); or use tensor_transport='nixl'",
                obj_id=obj_id,
            ) from None
        if not ours:
            with self._lock:  # (another fetch may evict and close the table: `_table`)
                gone = table.unlinked() if table._fd >= 0 else False
            if gone:
                raise PeerDiedError(f"{died} (its liveness table is gone)", obj_id=obj_id)
        return table

    def _table(self, name: str) -> _Table:
        with self._lock:
            table = self._mapped.get(name)
            if table is not None:
                self._mapped.move_to_end(name)
                return table
        table = _Table(name, create=False)
        with self._lock:
            known = self._mapped.get(name)
            if known is not None:  # another fetch opened it meanwhile
                table.close()
                return known
            self._mapped[name] = table
            while len(self._mapped) > TABLE_CACHE:
                self._mapped.popitem(last=False)  # not closed: a fetch may read it still (it goes with them)
        return table


def _freed(info: TransferInfo[CudaIpcMeta], during: bool, into: bool = False) -> ObjectFreedError:
    when = "during the read" if during else "before the fetch"
    written = (
        "; the into= buffers hold no valid value (the copy into them may have read memory the producer's "
        "allocator had already handed to other tensors)"
        if into
        else ""
    )
    return ObjectFreedError(
        f"cuda_ipc fetch of {info.obj_id}: the producer no longer holds it (freed {when}){written}", obj_id=info.obj_id
    )


def _checked(info: TransferInfo[Any]) -> CudaIpcMeta:
    """Refuse metadata its producer did not make: the table's name, slot, token, and each
    export's fields (its bytes are checked against the mapping once mapped: `_Use.mapped`).

    Runs on: consumer, before anything is opened or mapped.
    Raises: TransferError naming the field.
    """
    meta, specs, obj_id = info.meta, info.specs, info.obj_id

    def bad(what: str) -> TransferError:
        return TransferError(f"cuda_ipc fetch of {obj_id}: refused metadata: {what}", obj_id=obj_id)

    if type(meta) is not CudaIpcMeta:
        raise bad(f"a {type(meta).__name__}, not CudaIpcMeta")
    pid = meta.pid if info.producer_pid is None else info.producer_pid
    if type(meta.pid) is not int or meta.pid != pid or type(meta.host) is not str:
        raise bad(f"pid {meta.pid!r} is not the producer's (process {pid})")
    m = TABLE_NAME.fullmatch(meta.table) if type(meta.table) is str else None
    if m is None or int(m[1]) != pid:
        raise bad(f"liveness table {meta.table!r} is not one the producer (process {pid}) makes")
    if type(meta.slot) is not int or not 0 <= meta.slot < SLOTS_PER_TABLE:
        raise bad(f"slot {meta.slot!r} (0 to {SLOTS_PER_TABLE - 1})")
    if type(meta.token) is not int or not 1 <= meta.token <= TOKEN_END:
        raise bad(f"token {meta.token!r}")
    if type(meta.tensors) is not tuple or len(meta.tensors) != len(specs):
        raise bad(f"{len(meta.tensors) if type(meta.tensors) is tuple else meta.tensors!r} exports for {len(specs)} tensor(s)")
    for i, (t, spec) in enumerate(zip(meta.tensors, specs)):
        if t is None and spec.nbytes == 0:
            continue
        if type(t) is not IpcTensor or type(t.handle) is not bytes or len(t.handle) != _cudadrv.HANDLE_BYTES:
            raise bad(f"tensor {i}'s export is not one a producer makes")
        if type(t.device_uuid) is not str or len(t.device_uuid) > 64 or type(t.offset) is not int:
            raise bad(f"tensor {i}'s device or offset")
        if not 0 <= t.offset <= MAX_SPEC_BYTES or t.nbytes != spec.nbytes or type(t.nbytes) is not int:
            raise bad(f"tensor {i} at offset {t.offset!r}, {t.nbytes!r} bytes, where its spec holds {spec.nbytes}")
    return meta


def _export(t: torch.Tensor, nbytes: int) -> IpcTensor:
    """Return the IPC export of `t`'s bytes (the handle of its allocation; no copy)."""
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    try:
        handle, base, _ = _cudadrv.export(t.data_ptr(), index)
    except _cudadrv.CudaDriverError as exc:
        raise TransportUnavailableError(
            f"cuda_ipc cannot export a tensor on {t.device}: {exc}. CUDA IPC needs memory from "
            "cudaMalloc (PyTorch's default allocator, not PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "or cudaMallocAsync) on a GPU that is not a MIG instance; use tensor_transport='nixl'"
        ) from exc
    return IpcTensor(_uuid(index), handle, t.data_ptr() - base, nbytes)


def _map_index(m: IpcTensor) -> int:
    """The device a segment is mapped on here when first mapped: the producer's GPU, else (hidden
    here: peer access) this thread's current one. Every fetch of it lands there while it stays mapped."""
    index = _uuids().get(m.device_uuid)
    return index if index is not None else torch.cuda.current_device()


@dataclass
class _Mapped:
    """One segment mapped here: its address and size once mapped (a future), and its users."""

    future: concurrent.futures.Future[tuple[int, int]]
    index: int  # the device it is mapped on
    users: int = 0
    idle_since: float = 0.0  # time.monotonic() when the last user left


class _Mappings:
    """This process's mapped segments: each opened once, shared by the fetches using it.

    CUDA maps a handle once per process, so concurrent fetches from one segment share
    the mapping; it is closed about MAP_IDLE_S after the last of them ends (one sweep on
    the I/O loop: a fetch wakes no other thread). Thread-safe: fetches run on their
    callers' loops.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[bytes, _Mapped] = {}  # handle -> its mapping
        self._sweeper = _segments.IdleSweep(self._sweep, lambda: MAP_IDLE_S)

    def using(self, tensors: list[IpcTensor]) -> _Use:
        return _Use(self, tensors)

    def acquire(self, m: IpcTensor) -> _Mapped:
        """Count a user of `m`'s segment; return its mapping (its future gives the segment's
        address here once mapped, and its size)."""
        with self._lock:
            entry = self._maps.get(m.handle)
            if entry is None:
                entry = _Mapped(concurrent.futures.Future(), _map_index(m))
                # (Raises once the pool is shut down, at exit: then nothing is kept.)
                job = _io.pool().submit(_open_into, entry.future, m.handle, entry.index)
                job.add_done_callback(functools.partial(_never_ran, entry.future))
                self._maps[m.handle] = entry
            entry.users += 1
            return entry

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._maps[handle]
            entry.users -= 1
            if entry.users:
                return
            fut = entry.future
            if fut.done() and (fut.cancelled() or fut.exception() is not None):
                del self._maps[handle]  # a map that failed: the next fetch tries anew
                return
            entry.idle_since = time.monotonic()
        self._sweeper.start()

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        with self._lock:
            idle = {h: e for h, e in self._maps.items() if e.users == 0}
            for e in idle.values():
                if not e.future.done():  # still being mapped (its fetch was cancelled): idle from its end
                    e.idle_since = time.monotonic()
            gone = [(h, e) for h, e in idle.items() if e.idle_since <= cutoff]
            for h, _ in gone:
                del self._maps[h]
            left = _segments.oldest(e for h, e in idle.items() if h in self._maps)
        for h, e in gone:
            if not e.future.cancelled() and e.future.exception() is None:
                try:
                    _io.pool().submit(_close, e.future.result()[0], e.index)
                except RuntimeError:  # the pool is shut down (at exit): the process's end unmaps it
                    log.debug("rdt_async: cuda_ipc left a segment mapped at exit (handle %s...)", h[:8].hex())
        return left


class _Use:
    """The segments one fetch reads, mapped for as long as the `with` block runs."""

    def __init__(self, maps: _Mappings, tensors: list[IpcTensor]) -> None:
        self._maps, self._tensors = maps, tensors
        self.sources: list[torch.Tensor] = []

    def __enter__(self) -> _Use:
        self._entries: list[_Mapped] = []
        try:
            for m in self._tensors:
                self._entries.append(self._maps.acquire(m))
        except BaseException:
            self.__exit__()  # the segments counted so far
            raise
        return self

    @property
    def devices(self) -> list[torch.device]:
        """The device each segment is mapped on here: its bytes' tensor is on it."""
        return [torch.device("cuda", e.index) for e in self._entries]

    async def mapped(self) -> None:
        """Wait until every segment is mapped; set `sources`, the tensors' bytes in them.

        Raises: _MapFailed (the driver refused a mapping), TransferError.
        """
        # Shielded: the mapping is shared with other fetches, and a cancel reaching its
        # future would leave the handle opened but never closed (and every later fetch of the
        # segment failing on a cancelled future).
        mapped = []
        for e, m in zip(self._entries, self._tensors):
            f = e.future
            try:
                mapped.append(f.result() if f.done() else await asyncio.shield(asyncio.wrap_future(f)))
            except _cudadrv.CudaDriverError as exc:
                raise _MapFailed(exc, m.device_uuid, e.index) from exc
        for (_, size), m in zip(mapped, self._tensors):
            if m.offset + m.nbytes > size:  # the metadata came from another process
                raise TransferError(
                    f"cuda_ipc fetch: refused metadata: {m.nbytes} bytes at offset {m.offset} of a mapped "
                    f"allocation of {size}"
                )
        self.sources = [
            _wrap(a + m.offset, m.nbytes, e.index) for (a, _), m, e in zip(mapped, self._tensors, self._entries)
        ]

    def __exit__(self, *exc: Any) -> None:
        self.sources = []
        for m in self._tensors[: len(self._entries)]:
            self._maps.release(m.handle)


_mappings = _Mappings()


class _MapFailed(Exception):
    """The driver refused to map a segment (`__cause__`: its CudaDriverError)."""

    def __init__(self, exc: _cudadrv.CudaDriverError, uuid: str, index: int) -> None:
        super().__init__(str(exc))
        self.code, self.uuid, self.index = exc.code, uuid, index

    def error(self, obj_id: str) -> RDTError:
        """What a fetch of `obj_id` raises, its producer alive and holding it: the path's
        limit (TransportUnavailableError) for the CUresults that say so, else TransferError."""
        what = f"cuda_ipc fetch of {obj_id}: cannot map the producer's memory on GPU {self.uuid} from cuda:{self.index} here ({self})"
        if self.code in UNMAPPABLE:
            return TransportUnavailableError(
                f"{what}: CUDA IPC needs the producer's GPU visible in this process or peer access between "
                "the two GPUs (and no MIG instance); use tensor_transport='nixl'",
                obj_id=obj_id,
            )
        return TransferError(what, obj_id=obj_id)


def _open_into(fut: concurrent.futures.Future[tuple[int, int]], handle: bytes, index: int) -> None:
    """Map a segment (in the pool) for every fetch waiting on `fut`; a failure stays in
    `fut` (each fetch judges it for its own object: `_MapFailed`)."""
    try:
        address = _cudadrv.open_handle(handle, index)
        try:
            size = _cudadrv.bytes_from(address, index)
        except BaseException:
            _cudadrv.close_handle(address, index)
            raise
        fut.set_result((address, size))
    except BaseException as exc:
        fut.set_exception(exc)


def _never_ran(fut: concurrent.futures.Future[tuple[int, int]], job: concurrent.futures.Future[None]) -> None:
    """`_open_into`'s job was cancelled before it ran (its pool shut down, at exit): fail
    its mapping, which every fetch of the segment waits for."""
    if job.cancelled() and not fut.done():
        fut.set_exception(TransferError("cuda_ipc fetch: the process is exiting; the producer's memory was not mapped"))


def _close(address: int, index: int) -> None:
    """Unmap a segment no fetch uses (in the pool)."""
    try:
        _cudadrv.close_handle(address, index)
    except Exception as exc:
        log.warning("rdt_async: cuda_ipc could not unmap a producer's segment at %#x on cuda:%d: %s", address, index, exc)


class _DeviceBytes:
    """`nbytes` of device memory at an address, as torch.as_tensor takes it (no copy)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }


def _wrap(address: int, nbytes: int, index: int) -> torch.Tensor:
    return torch.as_tensor(_DeviceBytes(address, nbytes), device=torch.device("cuda", index))


def _copy_blocking(pairs: list[tuple[torch.Tensor, IpcTensor]], sources: list[torch.Tensor]) -> None:
    """Copy into CPU or strided buffers and wait until it has landed (in the pool)."""
    for (o, _), src in zip(pairs, sources):
        if o.is_contiguous():
            o.view(-1).view(torch.uint8).copy_(src)
        else:
            o.copy_(src.view(o.dtype).view(o.shape))
    _cuda.settle(sources + [o for o, _ in pairs])


async def _wait_landed(events: list[torch.cuda.Event], ends: float) -> None:
    """Wait on this loop until the copies behind `events`, expected to end at `ends`
    (perf_counter's clock), have landed."""

    def landed() -> bool:
        return all(e.query() for e in events)

    early = ends - WAKE_EARLY_S - time.perf_counter()
    if early > 0 and not landed():
        await asyncio.sleep(early)
    if not await _io.poll_closely(landed, max(ends, time.perf_counter()) + CLOSE_S):
        await _io.to_thread_finished(_wait_copy, events, 0.0)


def _wait_copy(events: list[torch.cuda.Event], ends: float) -> None:
    """Sleep until shortly before a copy's expected end (`ends`, on perf_counter's clock),
    then check its events after each 20 µs sleep (~70 µs apart with Linux's timer slack;
    in the pool)."""
    asleep = ends - 200e-6 - time.perf_counter()
    if asleep > 100e-6:
        time.sleep(asleep)
    while not all(e.query() for e in events):
        time.sleep(20e-6)


def _keep_for(tensors: list[torch.Tensor], seconds: float) -> None:
    """Hold `tensors` on the I/O loop for `seconds`, then let them go."""
    asyncio.get_running_loop().call_later(seconds, tensors.clear)


@functools.cache
def _mig_reason() -> str | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if visible.startswith("MIG-") or any(" MIG " in f" {n} " for n in names):
        return "CUDA IPC does not work on MIG instances (a limit of CUDA); use tensor_transport='nixl'"
    return None
