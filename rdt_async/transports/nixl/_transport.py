"""`nixl`: one-sided READs with NVIDIA NIXL (UCX), CPU and CUDA tensors, any node.

One agent per process, created on first use (`_agent.py`: its progress thread, and the
lock the I/O loop only tries). The consumer drives its own transfers from the I/O loop
(`_xfer.py`), and a producer also polls `get_new_notifs()` there with backoff: up to
every 20 ms while it has registered objects, every 0.25 s once it has none (with
RDT_NIXL_PROGRESS_US=0, no thread, that poll is all that progresses it).

Producer: `prepare` registers each tensor's *storage* once (refcounted, so views and
objects sharing a storage share a registration; non-contiguous tensors are copied
once to a contiguous tensor kept with the object) and returns everything a consumer
needs in the RDTObject: the agent's name, its connection metadata, partial metadata
for the object's regions, each tensor's address, and a liveness slot. A fetch costs
no round trip to the producer.

Liveness: each object owns a slot in a small registered table that holds a random
token while the object lives. A consumer READs the tensors, then READs the slot: a
token that no longer matches means the object was freed before or during the read,
and the fetch raises ObjectFreedError instead of returning stale bytes (after
deregistration, a CMA READ still returns whatever now lies at the old address).
`garbage_collect` clears the slot at once and deregisters after a bounded linger
(50 ms plus the time to read the object at 1 GiB/s, at most 10 s), so that a READ
racing an explicit `free()` never touches deregistered memory.

Why the linger and not read notifications: measured on NIXL 1.5.1, a notification
(on a READ or from `send_notif`) keeps the reader's *next* READ in progress until the
producer's agent progresses: 8 ms per fetch with a producer polling every 10 ms, and
polling fast enough to hide that costs a core. Reads racing a free happen only on an
explicit `free()`: while a consumer fetches, its RDTObject keeps the anchor alive.

Consumer: loads a producer's connection metadata once (cached per agent) and each
storage's partial metadata once (the same registration gives the same blob), registers
the destination (caller buffers when given) for the length of the fetch, posts the
READ (off the loop above `INLINE_BYTES`: under CMA the copy happens in the call) and
polls `check_xfer_state` with backoff. Cancelling releases the handle and the
temporary registration, after any copy already running in the pool has ended.
Objects up to `BOUNCE_BYTES` bound for CPU land in a bounce buffer registered once
and are copied out; from a connected producer on this host they are read on the
caller's thread (`receive_nowait`), with no hop through the I/O loop.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _alloc, _cuda, _io
from ..._errors import ObjectFreedError, PeerDiedError, TransportUnavailableError
from .. import _ucx
from .._base import Channel, TransferInfo, Transport, copy_into, local_device, pid_alive
from ._agent import Agent, import_reason
from ._xfer import Read, post, post_now

SLOTS_PER_TABLE = 1024
# Reads of CPU objects up to BOUNCE_BYTES land in a buffer registered once per process and
# are copied out (a registration costs more than copying 64 KiB). From the producer's own
# host, once connected, they are done on the caller's thread when NIXL's agent is free:
# under CMA the READ completes inside `transfer()` (~0.1 ms, no hop through the I/O loop).
BOUNCE_BYTES, BOUNCE_CHUNKS = 64 << 10, 16
MD_CACHE = 4096  # partial metadata blobs remembered per producer (loaded once each)
ALIGN = 64  # offsets of tensors that share a fetched block
LINGER_S, LINGER_MAX_S, LINGER_BYTES_PER_S = 0.05, 10.0, float(1 << 30)
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02
POLL_IDLE_S = 0.25  # the producer's pace once it holds nothing (consumers may still wire up)
# How long a fetch that lost its connection to a live producer may take to ask it anew
# whether the object was freed.
RECHECK_S = 5.0


@dataclass(frozen=True)
class NixlMeta:
    """What a consumer needs to read an object: agent, metadata, addresses, liveness slot."""

    agent: str
    conn: bytes  # the producer agent's connection metadata (the same for all its objects)
    regs: tuple[bytes, ...]  # partial metadata of the object's registered regions, per memory type
    # Per tensor: (address, nbytes, device index, "DRAM" | "VRAM"), or None when empty.
    descs: tuple[tuple[int, int, int, str] | None, ...]
    slot: int  # address of the liveness slot (uint64) in the producer
    token: int
    pid: int
    host: str


def _mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _dev_index(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else t.device.index or 0


@dataclass
class _Registration:
    """One registered storage: NIXL's descriptor list, who uses it, what keeps it alive."""

    dlist: Any
    keep: torch.Tensor  # holds the storage: registered memory is never freed under NIXL
    region: tuple[int, int, int]  # address, nbytes, device index
    mem_type: str
    users: int = 0


@dataclass
class _Object:
    keys: list[tuple[str, int, int]]
    slot: int
    nbytes: int
    contiguous: list[torch.Tensor]  # copies made for non-contiguous tensors


class NixlTransport(Transport[NixlMeta]):
    """One-sided NIXL READs (CPU and CUDA tensors; same node over CMA/CUDA IPC, or RDMA/TCP)."""

    name = "nixl"
    devices = ("cpu", "cuda")
    one_sided = True
    cross_device_buffers = True

    def __init__(self) -> None:
        self._agent: Agent | None = None
        self._agent_lock = threading.Lock()
        self._state = threading.Lock()  # guards the dicts below (never held while calling NIXL)
        self._regs: dict[tuple[str, int, int], _Registration] = {}
        self._objects: dict[str, _Object] = {}
        self._tables: list[tuple[torch.Tensor, Any]] = []  # liveness tables and their registrations
        self._free_slots: list[int] = []  # indexes over all tables
        self._landing: torch.Tensor | None = None  # where consumers read slots into
        self._free_landing: list[int] = []
        self._bounce: torch.Tensor | None = None  # where small reads land (registered once)
        self._free_bounce: list[int] = []
        self._conn: bytes = b""
        self._remotes: dict[str, str] = {}  # producer agent -> name NIXL knows it by
        self._connects = 0  # connections made so far: `_epochs` tells them apart
        self._epochs: dict[str, int] = {}  # producer agent -> which connection `_remotes` holds
        # producer agent -> partial metadata blobs already loaded (a storage registered
        # once on the producer yields the same blob for every object over it)
        self._loaded: dict[str, collections.OrderedDict[bytes, None]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._poll_idle = False  # the poller holds nothing and sleeps at POLL_IDLE_S
        self._poll_wake: asyncio.Future[None] | None = None
        self._host = socket.gethostname()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return import_reason() or _ucx.conflict("nixl")

    # -- what tests and operators look at --------------------------------------------

    @property
    def registrations(self) -> int:
        """Return how many storages this process has registered with NIXL now."""
        with self._state:
            return len(self._regs)

    @property
    def registered_bytes(self) -> int:
        with self._state:
            return sum(r.region[1] for r in self._regs.values())

    # -- the agent -------------------------------------------------------------------

    def agent(self) -> Agent:
        """Return this process's agent, creating it (~0.5 s) on first use. Blocking."""
        agent = self._agent
        if agent is not None and agent.pid == os.getpid():
            return agent
        with self._agent_lock:
            if self._agent is None or self._agent.pid != os.getpid():
                reason = import_reason()
                if reason is not None:
                    raise TransportUnavailableError(f"transport 'nixl' is unavailable: {reason}")
                _ucx.claim("nixl")
                agent = Agent()
                table = torch.zeros(SLOTS_PER_TABLE, dtype=torch.int64)
                dlist = agent.locked(agent.nixl.register_memory, table)
                conn = agent.locked(agent.nixl.get_partial_agent_metadata, dlist, True)
                self._landing = torch.zeros(SLOTS_PER_TABLE, dtype=torch.int64)
                agent.locked(agent.nixl.register_memory, self._landing)
                self._bounce = torch.zeros(BOUNCE_CHUNKS * BOUNCE_BYTES, dtype=torch.uint8)
                agent.locked(agent.nixl.register_memory, self._bounce)
                with self._state:
                    self._tables = [(table, dlist)]
                    self._free_slots = list(range(SLOTS_PER_TABLE - 1, -1, -1))
                    self._free_landing = list(range(SLOTS_PER_TABLE - 1, -1, -1))
                    self._free_bounce = list(range(BOUNCE_CHUNKS - 1, -1, -1))
                    self._loaded = {}
                    self._regs, self._objects, self._remotes, self._epochs = {}, {}, {}, {}
                self._conn = conn
                self._agent = agent
            return self._agent

    def warm_up(self) -> None:
        self.agent()

    async def _agent_async(self) -> Agent:
        agent = self._agent
        if agent is not None and agent.pid == os.getpid():
            return agent
        return await _io.to_thread(self.agent)

    # -- producer --------------------------------------------------------------------

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> NixlMeta:
        agent = self.agent()
        keys: list[tuple[str, int, int]] = []
        copies: list[torch.Tensor] = []
        descs: list[tuple[int, int, int, str] | None] = []
        slot = -1
        try:
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if nbytes == 0:
                    descs.append(None)
                    continue
                if not t.is_contiguous():
                    t = t.contiguous()
                    copies.append(t)
                keys.append(self._register(agent, t))
                descs.append((t.data_ptr(), nbytes, _dev_index(t), _mem_type(t)))
            slot, slot_addr, token, table_dlist = self._take_slot(agent)
            regs = self._partial_metadata(agent, keys, table_dlist)
        except BaseException:
            for dlist in self._drop(keys, slot):
                agent.locked(agent.nixl.deregister_memory, dlist)
            raise
        with self._state:
            self._objects[obj_id] = _Object(keys, slot, sum(d[1] for d in descs if d), copies)
        self._ensure_poller()
        return NixlMeta(agent.name, self._conn, regs, tuple(descs), slot_addr, token, os.getpid(), self._host)

    def garbage_collect(self, obj_id: str, meta: NixlMeta) -> None:
        with self._state:
            obj = self._objects.pop(obj_id, None)
            if obj is None:
                return
            table, _ = self._tables[obj.slot // SLOTS_PER_TABLE]
            table[obj.slot % SLOTS_PER_TABLE] = 0  # from now on every read of it fails
        linger = min(LINGER_MAX_S, LINGER_S + obj.nbytes / LINGER_BYTES_PER_S)
        _io.call_soon(self._retire_later, obj, linger)

    def _retire_later(self, obj: _Object, linger: float) -> None:
        asyncio.get_running_loop().call_later(linger, self._retire, obj)

    def _retire(self, obj: _Object) -> None:
        agent = self._agent
        if agent is not None and agent.pid == os.getpid():
            _deregister_soon(agent, self._drop(obj.keys, obj.slot))

    def _register(self, agent: Agent, t: torch.Tensor) -> tuple[str, int, int]:
        """Register the storage under `t` (once; refcounted) and return its key.

        Blocking: takes the agent. Runs on: producer (prepare) and consumer (pool).
        """
        key, known = self._use(t)
        if not known:
            region = self._region(t)
            self._add(key, t, agent.locked(agent.nixl.register_memory, [(*region, "")], key[0]), agent)
        return key

    def _register_nowait(self, agent: Agent, t: torch.Tensor) -> tuple[str, int, int] | None:
        """Register from the loop if that needs no wait (known storage, or a free agent)."""
        key, known = self._use(t)
        if known:
            return key
        dlist = agent.try_call(agent.nixl.register_memory, [(*self._region(t), "")], key[0], busy=None)
        if dlist is None:
            return None
        self._add(key, t, dlist, agent)
        return key

    def _use(self, t: torch.Tensor) -> tuple[tuple[str, int, int], bool]:
        key = (_mem_type(t), _dev_index(t), t.untyped_storage().data_ptr())
        with self._state:
            reg = self._regs.get(key)
            if reg is not None:
                reg.users += 1
                return key, True
        return key, False

    @staticmethod
    def _region(t: torch.Tensor) -> tuple[int, int, int]:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes(), _dev_index(t))

    def _add(self, key: tuple[str, int, int], t: torch.Tensor, dlist: Any, agent: Agent) -> None:
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        with self._state:
            reg = self._regs.get(key)
            if reg is None:
                self._regs[key] = _Registration(dlist, whole, self._region(t), key[0], 1)
                return
            reg.users += 1  # another thread registered it meanwhile: drop ours
        _deregister_soon(agent, [dlist])

    def _drop(self, keys: Sequence[tuple[str, int, int]], slot: int = -1) -> list[Any]:
        """Drop one use of each key; return the registrations nobody uses any more."""
        gone = []
        with self._state:
            for key in keys:
                reg = self._regs.get(key)
                if reg is None:
                    continue
                reg.users -= 1
                if reg.users == 0:
                    gone.append(self._regs.pop(key).dlist)
            if slot >= 0:
                self._free_slots.append(slot)
        return gone

    def _take_slot(self, agent: Agent) -> tuple[int, int, int, Any]:
        with self._state:
            if not self._free_slots:
                n = len(self._tables)
                table = torch.zeros(SLOTS_PER_TABLE, dtype=torch.int64)
                self._tables.append((table, None))
                self._free_slots = list(range((n + 1) * SLOTS_PER_TABLE - 1, n * SLOTS_PER_TABLE - 1, -1))
            slot = self._free_slots.pop()
            table, dlist = self._tables[slot // SLOTS_PER_TABLE]
        if dlist is None:  # a fresh table: register it once
            dlist = agent.locked(agent.nixl.register_memory, table)
            with self._state:
                self._tables[slot // SLOTS_PER_TABLE] = (table, dlist)
        token = secrets.randbits(62) + 1
        i = slot % SLOTS_PER_TABLE
        table[i] = token
        return slot, table.data_ptr() + 8 * i, token, dlist

    def _partial_metadata(self, agent: Agent, keys: Sequence[tuple[str, int, int]], table_dlist: Any) -> tuple[bytes, ...]:
        by_mem: dict[str, list[tuple[int, int, int, str]]] = {"DRAM": []}
        with self._state:
            for key in dict.fromkeys(keys):
                reg = self._regs[key]
                by_mem.setdefault(reg.mem_type, []).append((*reg.region, ""))
        table = self._tables_region(table_dlist)
        if table is not None:
            by_mem["DRAM"].append(table)
        out = []
        for mem, regions in by_mem.items():
            if regions:
                dlist = agent.nixl.get_reg_descs(regions, mem)
                out.append(agent.locked(agent.nixl.get_partial_agent_metadata, dlist, False))
        return tuple(out)

    def _tables_region(self, dlist: Any) -> tuple[int, int, int, str] | None:
        with self._state:
            for table, d in self._tables[1:]:
                if d is dlist:
                    return (table.data_ptr(), table.numel() * 8, 0, "")
        return None  # table 0 travels in the connection metadata

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done() or self._poll_idle:
            _io.call_soon(self._start_poller)

    def _start_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        elif self._poll_idle and self._poll_wake is not None and not self._poll_wake.done():
            self._poll_wake.set_result(None)  # objects again: back to the quick pace

    async def _poll(self) -> None:
        """Progress the agent, so that consumers can wire up, for as long as it lives.

        Runs on: producer (I/O loop). Backs off to POLL_MAX_S while objects are registered
        and nothing arrives, and to POLL_IDLE_S once none are: a consumer whose first
        contact is a fetch of an object freed meanwhile still wires up (and learns it is
        freed) instead of waiting forever for a producer that no longer progresses.
        """
        loop = asyncio.get_running_loop()
        delay = POLL_MIN_S
        while True:
            agent = self._agent
            if agent is None or agent.pid != os.getpid():
                return
            try:
                notifs = agent.try_call(agent.nixl.get_new_notifs, busy=None)
            except Exception:
                notifs = {}
            if notifs:
                delay = POLL_MIN_S
            with self._state:
                self._poll_idle = not self._regs
            self._poll_wake = loop.create_future()
            wake = loop.call_later(delay, _set_once, self._poll_wake)
            await self._poll_wake
            wake.cancel()
            if self._poll_idle and self._regs:
                delay = POLL_MIN_S  # woken by a new object
            else:
                delay = min(POLL_IDLE_S if self._poll_idle else POLL_MAX_S, delay * 2)

    # -- consumer --------------------------------------------------------------------

    async def receive(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        meta = info.meta
        agent = await self._agent_async()
        for again in (False, True):
            epoch = None
            try:
                if not _alive(meta):  # checked first: a READ posted to a dead agent leaks inside NIXL
                    raise _died(info)
                remote = await self._connect(agent, meta)
                epoch = self._epochs.get(meta.agent)
                out = await self._read_object(agent, remote, info, buffers)
                break
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if _is_disconnect(exc):
                    await self._forget(agent, meta.agent, epoch)
                    # One connection serves every read from that producer: a read of
                    # another object, freed under it, can break it for this one too.
                    if not isinstance(exc, PeerDiedError) and _alive(meta) and not again:
                        if await self._still_held(agent, info, exc):
                            continue  # read again, over the fresh connection
                if not isinstance(exc, (ObjectFreedError, PeerDiedError)) and not _alive(meta):
                    raise _died(info) from exc
                raise
        if buffers is None:
            return out
        strided = [(b, o) for b, o in zip(buffers, out) if b is not o]
        if strided:  # caller buffers that were not contiguous received a temporary
            # Off the caller's thread: finished on return (the caller's streams do not order against ours).
            await _io.to_thread_finished(_cuda.settled, copy_into, [b for b, _ in strided], [o for _, o in strided])
        return list(buffers)

    async def _read_object(
        self, agent: Agent, remote: str, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """READ the tensors, then the liveness slot; raise ObjectFreedError if it changed."""
        meta = info.meta
        out, dsts = self._destinations(info, buffers)
        # Device memory just allocated here may still be in use by work queued on this
        # thread's streams (the caching allocator hands it out again); NIXL writes it
        # outside any stream. (Caller buffers were waited for on the caller's streams.)
        await _cuda.wait(_cuda.record(out))
        pairs = [(d, s) for d, s in zip(dsts, meta.descs) if s is not None]
        bounce = self._take_bounce(pairs)
        lands = self._bounce_views(bounce, pairs) if bounce >= 0 else [d for d, _ in pairs]
        landing, lslot = self._take_landing()
        keys: list[tuple[str, int, int]] = []
        try:
            keys = await self._register_all(agent, (lands if bounce < 0 else []) + ([lslot] if landing < 0 else []))
            error: Exception | None = None
            for group in _by_device([(d, s) for d, (_, s) in zip(lands, pairs)]):
                try:
                    await post(agent, remote, Read(
                        [(d.data_ptr(), s[1], _dev_index(d)) for d, s in group],
                        [s[:3] for _, s in group],
                        _mem_type(group[0][0]), group[0][1][3],
                    ))
                except Exception as exc:  # a read of freed memory can fail: ask the slot
                    error = exc
                    break
            lslot.zero_()
            try:
                await post(agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]))
            except Exception:
                if error is not None:
                    raise error from None
                raise
            _check_slot(lslot, info, error)
            if error is not None:
                raise error
            if bounce >= 0:
                copy_into([d for d, _ in pairs], lands)
        finally:
            self._give_landing(landing)
            self._give_bounce(bounce)
            if keys:
                _deregister_soon(agent, self._drop(keys))
        return out

    def _destinations(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Return the tensors to hand back and, as flat bytes, where each READ lands.

        Without caller buffers, the tensors of one device are views of one block: one
        registration per fetch instead of one per tensor.
        """
        if buffers is None:
            out = _views_of_blocks(info.specs)
        else:
            out = [
                b if b.is_contiguous() else torch.empty(spec.shape, dtype=spec.dtype, device=b.device)
                for b, spec in zip(buffers, info.specs)
            ]
        dsts = [t.reshape(-1).view(torch.uint8) if t.numel() else t for t in out]
        return out, dsts

    async def _connect(self, agent: Agent, meta: NixlMeta) -> str:
        """Load the producer's metadata: its connection once, the object's regions each time."""
        remote = self._remotes.get(meta.agent)
        if remote is None:
            try:
                name = await agent.call(agent.nixl.add_remote_agent, meta.conn, slow=True)
            except Exception as exc:
                raise PeerDiedError(
                    f"nixl: cannot connect to the producer's agent {meta.agent} (pid {meta.pid} on "
                    f"{meta.host}): it died or is unreachable ({type(exc).__name__}: {exc})"
                ) from exc
            remote = self._remotes[meta.agent] = name.decode() if isinstance(name, bytes) else name
            self._connects += 1
            self._epochs[meta.agent] = self._connects
        for md in self._unloaded(meta):
            await agent.call(agent.nixl.add_remote_agent, md)
            self._mark_loaded(meta.agent, md)
        return remote

    def _unloaded(self, meta: NixlMeta) -> list[bytes]:
        """Return the object's partial metadata blobs this agent has not loaded yet."""
        with self._state:
            known = self._loaded.get(meta.agent)
            if known is None:
                return list(meta.regs)
            out = []
            for md in meta.regs:
                if md in known:
                    known.move_to_end(md)
                else:
                    out.append(md)
            return out

    def _mark_loaded(self, producer: str, md: bytes) -> None:
        with self._state:
            known = self._loaded.setdefault(producer, collections.OrderedDict())
            known[md] = None
            while len(known) > MD_CACHE:
                known.popitem(last=False)  # forgetting only costs a reload

    async def _forget(self, agent: Agent, producer: str, epoch: int | None) -> None:
        """Drop the producer's connection `epoch` (None: whichever) and its metadata.

        Reads that broke on one connection each drop it: the first to do so may already
        have connected anew, and that connection stays.
        """
        if epoch is not None and self._epochs.get(producer) != epoch:
            return
        self._epochs.pop(producer, None)
        with self._state:
            self._loaded.pop(producer, None)
        remote = self._remotes.pop(producer, None)
        if remote is not None:
            try:
                await agent.call(agent.nixl.remove_remote_agent, remote)
            except Exception:
                pass

    async def _still_held(self, agent: Agent, info: TransferInfo[NixlMeta], cause: BaseException) -> bool:
        """Read the liveness slot over a fresh connection: True if the object is still held.

        A READ of memory the producer has unmapped (a `free()` racing the read past the
        linger) fails its UCX endpoint for good: NIXL reports the producer disconnected,
        and the slot cannot be read over that endpoint any more. Raises ObjectFreedError
        (from `cause`) if the slot changed; any other failure here gives False, and the
        caller's error stands.
        """
        meta = info.meta
        landing, lslot = self._take_landing()
        keys: list[tuple[str, int, int]] = []
        freed: ObjectFreedError | None = None
        held, epoch = False, None
        try:
            async with asyncio.timeout(RECHECK_S):
                keys = await self._register_all(agent, [lslot] if landing < 0 else [])
                remote = await self._connect(agent, meta)
                epoch = self._epochs.get(meta.agent)
                lslot.zero_()
                await post(agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]))
            _check_slot(lslot, info)
            held = True
        except ObjectFreedError as exc:
            freed = exc
        except Exception as exc:
            if _is_disconnect(exc):
                await self._forget(agent, meta.agent, epoch)
        finally:
            self._give_landing(landing)
            if keys:
                _deregister_soon(agent, self._drop(keys))
        if freed is not None:
            raise freed from cause
        return held

    async def _register_all(self, agent: Agent, dsts: list[torch.Tensor]) -> list[tuple[str, int, int]]:
        keys: list[tuple[str, int, int]] = []
        try:
            for d in dsts:
                key = self._register_nowait(agent, d) if d.device.type == "cpu" else None
                if key is None:
                    key = await _io.to_thread_finished(self._register, agent, d, undo=lambda k: _deregister_soon(agent, self._drop([k])))
                keys.append(key)
        except BaseException:
            _deregister_soon(agent, self._drop(keys))
            raise
        return keys

    def receive_nowait(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """Read a small CPU object of a connected producer on this host, on this thread.

        Under CMA the READ completes inside `transfer()`, so this costs no hop through the
        I/O loop. Anything else (a busy agent, no free bounce chunk, a READ NIXL leaves in
        progress, an error) returns None and the fetch takes the usual path; a READ left in
        progress is finished and released on the I/O loop.
        Raises: ObjectFreedError if the liveness slot says the object is gone.
        """
        meta = info.meta
        agent, remote = self._agent, self._remotes.get(meta.agent)
        if (
            agent is None or remote is None or agent.pid != os.getpid() or meta.host != self._host
            or any(d is not None and d[3] != "DRAM" for d in meta.descs)
            or (buffers is not None and any(b.device.type != "cpu" for b in buffers))
            or not _alive(meta)  # the usual path says so
        ):
            return None
        out, dsts = self._destinations(info, buffers)
        pairs = [(d, s) for d, s in zip(dsts, meta.descs) if s is not None]
        bounce = self._take_bounce(pairs)
        if bounce < 0:
            return None
        landing, lslot = self._take_landing()
        if landing < 0 or not agent.lock.acquire(blocking=False):
            self._give_landing(landing)
            self._give_bounce(bounce)
            return None

        def give_back() -> None:
            self._give_landing(landing)
            self._give_bounce(bounce)

        handed_off = False  # then the I/O loop gives bounce and landing back
        try:
            nx = agent.nixl
            for md in self._unloaded(meta):
                nx.add_remote_agent(md)
                self._mark_loaded(meta.agent, md)
            lands = self._bounce_views(bounce, pairs)
            local = [(b.data_ptr(), s[1], 0) for b, (_, s) in zip(lands, pairs)]
            if pairs and not post_now(agent, remote, Read(local, [s[:3] for _, s in pairs]), give_back):
                handed_off = True
                return None
            lslot.zero_()
            if not post_now(agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]), give_back):
                handed_off = True
                return None
            _check_slot(lslot, info)
            copy_into([d for d, _ in pairs], lands)
        except ObjectFreedError:
            raise
        except Exception:  # the usual path reads again and reports what is wrong
            return None
        finally:
            agent.lock.release()
            if not handed_off:
                give_back()
        if buffers is None:
            return out
        return copy_into(buffers, out) if any(b is not o for b, o in zip(buffers, out)) else list(buffers)

    def _take_bounce(self, pairs: list[tuple[torch.Tensor, Any]]) -> int:
        """Return a free bounce chunk for a read this small into CPU memory, else -1."""
        if sum(-(-s[1] // ALIGN) * ALIGN for _, s in pairs) > BOUNCE_BYTES or any(d.device.type != "cpu" for d, _ in pairs):
            return -1
        with self._state:
            return self._free_bounce.pop() if self._free_bounce and self._bounce is not None else -1

    def _give_bounce(self, i: int) -> None:
        if i >= 0:
            with self._state:
                self._free_bounce.append(i)

    def _bounce_views(self, i: int, pairs: list[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
        assert self._bounce is not None
        chunk, off, out = self._bounce[i * BOUNCE_BYTES : (i + 1) * BOUNCE_BYTES], 0, []
        for _, s in pairs:
            out.append(chunk[off : off + s[1]])
            off += -(-s[1] // ALIGN) * ALIGN
        return out

    def _take_landing(self) -> tuple[int, torch.Tensor]:
        with self._state:
            i = self._free_landing.pop() if self._free_landing else -1
        if i < 0 or self._landing is None:
            return -1, torch.zeros(1, dtype=torch.int64)  # registered for this fetch only
        return i, self._landing[i : i + 1]

    def _give_landing(self, i: int) -> None:
        if i >= 0:
            with self._state:
                self._free_landing.append(i)


def _check_slot(lslot: torch.Tensor, info: TransferInfo[NixlMeta], cause: Exception | None = None) -> None:
    """Raise ObjectFreedError unless the liveness slot just read still holds the object's token."""
    if int(lslot.item()) != info.meta.token:
        raise ObjectFreedError(
            f"nixl fetch of {info.obj_id}: the producer no longer holds it (it was freed)", obj_id=info.obj_id
        ) from cause


def _views_of_blocks(specs: Sequence[Any]) -> list[torch.Tensor]:
    """Allocate one byte block per device and return each spec's tensor as a view of it."""
    offsets, sizes = [], {}
    for spec in specs:
        device = local_device(spec.device)
        offsets.append((device, sizes.get(device, 0)))
        sizes[device] = sizes.get(device, 0) + -(-spec.nbytes // ALIGN) * ALIGN
    blocks = {d: _alloc.empty((n,), torch.uint8, d) for d, n in sizes.items()}  # CPU: reused, warm
    out = []
    for spec, (device, off) in zip(specs, offsets):
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
        else:
            out.append(blocks[device][off : off + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out


def _by_device(
    pairs: list[tuple[torch.Tensor, tuple[int, int, int, str]]],
) -> list[list[tuple[torch.Tensor, tuple[int, int, int, str]]]]:
    """Group reads by (local device, remote memory): one NIXL request per group."""
    groups: dict[Any, list[tuple[torch.Tensor, tuple[int, int, int, str]]]] = {}
    for d, s in pairs:
        groups.setdefault((str(d.device), s[3], s[2]), []).append((d, s))
    return list(groups.values())


def _deregister_soon(agent: Agent, dlists: list[Any]) -> None:
    for dlist in dlists:
        agent.call_soon(agent.nixl.deregister_memory, dlist)


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ in ("nixlRemoteDisconnectError", "nixlNotAllowedError") or isinstance(
        exc, PeerDiedError
    )


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _died(info: TransferInfo[NixlMeta]) -> PeerDiedError:
    meta = info.meta
    return PeerDiedError(
        f"nixl fetch of {info.obj_id}: the producer (pid {meta.pid} on {meta.host}) died", obj_id=info.obj_id
    )


def _alive(meta: NixlMeta) -> bool:
    """Say whether the producer may be alive (only checkable on its own host)."""
    return meta.host != socket.gethostname() or pid_alive(meta.pid)
