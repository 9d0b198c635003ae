"""The producer's objects: registered tensors, a liveness slot each, released after a linger.

`prepare` registers each tensor's *storage* once (refcounted, so views and objects
sharing a storage share a registration; non-contiguous tensors are copied once to a
contiguous tensor kept with the object) and returns everything a consumer needs: the
agent's name, its connection metadata, partial metadata for the object's regions, each
tensor's address, and a liveness slot. A fetch costs no round trip to the producer.

`collect` clears the slot at once and deregisters after a bounded linger (50 ms plus the
time to read the object at 1 GiB/s, at most 10 s), so that a READ racing an explicit
`free()` never touches deregistered memory.

Why the linger and not read notifications: measured on NIXL 1.5.1, a notification (on a
READ or from `send_notif`) keeps the reader's *next* READ in progress until the
producer's agent progresses: 8 ms per fetch with a producer polling every 10 ms, and
polling fast enough to hide that costs a core. Reads racing a free happen only on an
explicit `free()`: while a consumer fetches, its RDTObject keeps the anchor alive.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ... import _io
from .._kit import digest
from ._agent import Agent
from ._liveness import Slots
from ._memory import Key, Registrations, dev_index, mem_type
from ._meta import NixlMeta

# How long a freed object's memory stays registered for READs already under way: their
# bytes' time at LINGER_BYTES_PER_S, under what `auto` expects of NIXL across hosts (~0.86
# GB/s). (A READ that outlives it fails, or reads bytes its liveness token then refuses.)
LINGER_S, LINGER_MAX_S, LINGER_BYTES_PER_S = 0.05, 10.0, float(512 << 20)


@dataclass
class _Object:
    keys: list[Key]
    slot: int
    nbytes: int
    contiguous: list[torch.Tensor]  # copies made for non-contiguous tensors


class Exports:
    """The objects this process prepared, by id; `_lock` guards the table."""

    def __init__(self, agent: Agent, memory: Registrations, slots: Slots, host: str) -> None:
        self._agent, self._memory, self._slots, self._host = agent, memory, slots, host
        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> NixlMeta:
        """Register the tensors, hold a liveness slot, return what consumers need.

        Runs on: producer. Blocking: takes the agent.
        """
        keys: list[Key] = []
        copies: list[torch.Tensor] = []
        descs: list[tuple[int, int, int, str] | None] = []
        slot = -1
        try:
            held = []
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if nbytes == 0:
                    descs.append(None)
                    continue
                if not t.is_contiguous():
                    t = t.contiguous()
                    copies.append(t)
                held.append(t)
                descs.append((t.data_ptr(), nbytes, dev_index(t), mem_type(t)))
            keys = self._memory.register_many(held)  # the new storages in one call into NIXL
            slot, slot_addr, token, table = self._slots.take(digest(obj_id, descs))
            regs = self._partial_metadata(keys, table)
        except BaseException:
            self._memory.release_now(keys)
            if slot >= 0:
                self._slots.give(slot)
            raise
        with self._lock:
            self._objects[obj_id] = _Object(keys, slot, sum(d[1] for d in descs if d), copies)
        return NixlMeta(self._agent.name, self._slots.conn, regs, tuple(descs), slot_addr, token, os.getpid(), self._host)

    def collect(self, obj_id: str) -> None:
        """Fail every read of the object from now on; deregister it after the linger.

        Runs on: producer. Quick; a second call does nothing.
        """
        with self._lock:
            obj = self._objects.pop(obj_id, None)
        if obj is None:
            return
        self._slots.clear(obj.slot)
        linger = min(LINGER_MAX_S, LINGER_S + obj.nbytes / LINGER_BYTES_PER_S)
        _io.call_soon(self._retire_later, obj, linger)

    def _retire_later(self, obj: _Object, linger: float) -> None:
        asyncio.get_running_loop().call_later(linger, self._retire, obj)

    def _retire(self, obj: _Object) -> None:
        if self._agent.pid == os.getpid():
            self._slots.give(obj.slot)
            self._memory.release(obj.keys)

    def _partial_metadata(self, keys: Sequence[Key], table: tuple[int, int, int, str] | None) -> tuple[bytes, ...]:
        """The partial metadata of the object's regions (and its slot's table), per memory type."""
        by_mem = self._memory.regions(keys)
        if table is not None:
            by_mem["DRAM"].append(table)
        nx, out = self._agent.nixl, []
        for mem, regions in by_mem.items():
            if regions:
                dlist = nx.get_reg_descs(regions, mem)
                out.append(self._agent.locked(nx.get_partial_agent_metadata, dlist, False))
        return tuple(out)
