"""Liveness slots: how a consumer learns that the object it just read was freed, and
that it read what its producer exported for it.

Each object owns a slot in a small registered table (the producer's) that holds a random
token while the object lives, and a digest of the object's id and tensor descriptors
(address, length, device, memory: `digest`). A consumer READs the tensors, then READs the
slot: a token that no longer matches means the object was freed before or during the
read, and the fetch raises ObjectFreedError instead of returning stale bytes (after
deregistration, a CMA READ still returns whatever now lies at the old address). A digest
that does not match the ref's descriptors means the ref was altered to READ other memory
of the producer (nothing on the producer's side bounds a READ: see `_check`): the fetch
raises TransferError. Either way what the READs wrote where the caller sees it is zeroed
first (`ReadPlan`): nothing read reaches the caller.
"""

from __future__ import annotations

import secrets
import threading

import torch

from ..._errors import ObjectFreedError, TransferError
from .._base import TransferInfo
from .._kit import digest
from ._agent import Agent
from ._meta import NixlMeta

SLOTS_PER_TABLE = 1024
SLOT_BYTES = 16  # the token, then the digest (int64 each)


class Slots:
    """The producer's liveness tables, registered once each, and which slots are free.

    Table 0 is registered with the agent and travels in its connection metadata (`conn`);
    later tables travel in the partial metadata of the objects that use them. `_lock`
    guards the tables and the free list; it is never held while calling NIXL.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        table = torch.zeros(2 * SLOTS_PER_TABLE, dtype=torch.int64)
        dlist = agent.locked(agent.nixl.register_memory, table)
        self.conn: bytes = agent.locked(agent.nixl.get_partial_agent_metadata, dlist, True)
        self._tables = [table]
        self._free = list(range(SLOTS_PER_TABLE - 1, -1, -1))  # indexes over all tables

    def take(self, bound: int) -> tuple[int, int, int, tuple[int, int, int, str] | None]:
        """Hold a slot for a new object whose `digest` is `bound`: return it, its address,
        its token, and its table's region when the consumer needs it in the object's
        metadata (None for table 0).

        Blocking when every table is full: a new one is registered (takes the agent).
        """
        with self._lock:
            slot = self._free.pop() if self._free else -1
            table = self._tables[slot // SLOTS_PER_TABLE] if slot >= 0 else None
        if table is None:
            table = torch.zeros(2 * SLOTS_PER_TABLE, dtype=torch.int64)
            self._agent.locked(self._agent.nixl.register_memory, table)
            with self._lock:
                n = len(self._tables)
                self._tables.append(table)
                self._free.extend(range((n + 1) * SLOTS_PER_TABLE - 1, n * SLOTS_PER_TABLE - 1, -1))
                slot = self._free.pop()
        token = secrets.randbits(62) + 1
        i = slot % SLOTS_PER_TABLE
        table[2 * i + 1] = bound
        table[2 * i] = token
        region = None if slot < SLOTS_PER_TABLE else (table.data_ptr(), table.numel() * 8, 0, "")
        return slot, table.data_ptr() + SLOT_BYTES * i, token, region

    def clear(self, slot: int) -> None:
        """Zero the slot's token: from now on every read of its object fails."""
        with self._lock:
            table = self._tables[slot // SLOTS_PER_TABLE]
            table[2 * (slot % SLOTS_PER_TABLE)] = 0

    def give(self, slot: int) -> None:
        """Free a slot cleared (or never handed out) for another object."""
        with self._lock:
            self._free.append(slot)


def check_slot(lslot: torch.Tensor, info: TransferInfo[NixlMeta], cause: Exception | None = None) -> None:
    """Raise ObjectFreedError unless the liveness slot just read (`lslot`: token, digest)
    still holds the object's token; TransferError unless it holds the digest of the ref's
    descriptors."""
    token, bound = (int(x) for x in lslot.tolist())
    if token != info.meta.token:
        raise ObjectFreedError(
            f"nixl fetch of {info.obj_id}: the producer no longer holds it (it was freed)", obj_id=info.obj_id
        ) from cause
    if bound != digest(info.obj_id, info.meta.descs):
        raise TransferError(
            f"nixl fetch of {info.obj_id}: its ref's tensor descriptors are not the ones its producer exported "
            "for it (the ref was altered); what was read was discarded",
            obj_id=info.obj_id,
        ) from cause
