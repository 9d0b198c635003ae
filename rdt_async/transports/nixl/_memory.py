"""Memory registered with NIXL: each storage once, refcounted, however many tensors use it.

Views and objects sharing a storage share one registration, and the registration holds
the storage so that registered memory is never freed under NIXL. A producer registers
its tensors' storages for as long as their objects live; a consumer registers its
destinations for the length of one fetch; a user's `rdt.register_memory` holds them
until it is closed (`hold` / `unhold`). Freeing a storage's last user deregisters it
without waiting for the agent. `made` and `dropped` count the storages registered and
deregistered.

The new storages of one call (an object's tensors, a fetch's destinations) are registered
in one call into NIXL, and deregistered together once none of them is used: NIXL's
deregistration of one list costs time in proportion to every list registered (52 us a
call with 16,000 registered here), so 16,000 lists registered and dropped one by one
took seconds; one list of 16,000 takes milliseconds. A storage of a list whose others are
still used stays registered (and alive) until the last of them is done.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _io
from ._agent import Agent

Key = tuple[str, int, int]  # memory type, device index, storage address


def mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def dev_index(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else t.device.index or 0


@dataclass
class _Batch:
    """One call's registration in NIXL (a descriptor list of one or more storages)."""

    dlist: Any
    keys: list[Key]  # its storages in the table
    live: int = 0  # of those, the ones in use
    keep: tuple[torch.Tensor, ...] = ()  # storages it registered that another call put in the table first


@dataclass
class _Registration:
    """One registered storage: its call's registration, who uses it, what keeps it alive."""

    batch: _Batch
    keep: torch.Tensor  # holds the storage: registered memory is never freed under NIXL
    region: tuple[int, int, int]  # address, nbytes, device index
    mem_type: str
    users: int = 0
    held: int = 0  # of the users, the user's registrations (`hold`)


class Registrations:
    """The storages this process's agent has registered, by key. Thread-safe.

    `_lock` guards the table and the use counts; it is never held while calling NIXL.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._regs: dict[Key, _Registration] = {}
        self.made = 0  # storages registered with NIXL (calls to register_memory), ever
        self.dropped = 0  # storages deregistered, ever

    def __len__(self) -> int:
        with self._lock:
            return len(self._regs)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.region[1] for r in self._regs.values())

    def busy(self) -> bool:
        """Say whether anything but a user's registration uses registered memory now."""
        with self._lock:
            return any(r.users > r.held for r in self._regs.values())

    def stats(self) -> dict[str, int]:
        """Return what is registered now (and by the user), and the calls into NIXL so far."""
        with self._lock:
            held = [r for r in self._regs.values() if r.held]
            return {
                "storages": len(self._regs),
                "bytes": sum(r.region[1] for r in self._regs.values()),
                "held_storages": len(held),
                "held_bytes": sum(r.region[1] for r in held),
                "registered_total": self.made,
                "deregistered_total": self.dropped,
            }

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[Key]:
        """Register each tensor's storage for the user until `unhold`; return the keys.

        Blocking: takes the agent where a storage is new. Runs on: either side (a user's
        `rdt.register_memory`, off the event loop). On an error nothing stays registered.
        """
        keys = self.register_many(tensors)
        with self._lock:
            for key in keys:
                self._regs[key].held += 1
        return keys

    def unhold(self, keys: Sequence[Key]) -> None:
        """Drop the user's uses of `keys`; what objects or fetches still use stays registered."""
        with self._lock:
            for key in keys:
                reg = self._regs.get(key)
                if reg is not None and reg.held > 0:
                    reg.held -= 1
        self.release(keys)

    def register(self, t: torch.Tensor) -> Key:
        """`register_many` of one tensor."""
        return self.register_many([t])[0]

    def register_many(self, tensors: Sequence[torch.Tensor]) -> list[Key]:
        """Register the storage under each tensor (once; refcounted), the new ones in one
        call into NIXL per memory type, and return their keys.

        Blocking: takes the agent where a storage is new. Runs on: producer (prepare) and
        either side's pool. On an error nothing stays taken.
        """
        keys, new = self._use_all(tensors)
        done: set[str] = set()  # memory types whose new storages are in the table
        try:
            for mem, items in new.items():
                agent = self._agent
                self._add(agent.locked(agent.nixl.register_memory, _regions(items), mem), items)
                done.add(mem)
        except BaseException:
            self.release_now([k for k in keys if k[0] in done or k not in new.get(k[0], {})])
            raise
        return keys

    async def register_all(self, tensors: Sequence[torch.Tensor]) -> list[Key]:
        """`register_many` from the I/O loop: on it where nothing is new, or the new storages
        are CPU memory and the agent is free; else in the pool.

        A cancel lets a registration already in the pool end, then releases them all.
        """
        keys, new = self._use_all(tensors)
        if not new:
            return keys
        known = [k for k in keys if k not in new.get(k[0], {})]
        if list(new) == ["DRAM"]:
            agent = self._agent
            try:
                dlist = agent.try_call(agent.nixl.register_memory, _regions(new["DRAM"]), "DRAM", busy=None)
            except BaseException:
                self.release(known)
                raise
            if dlist is not None:
                self._add(dlist, new["DRAM"])
                return keys
        self.release(known)  # taken again in the pool, with the new ones
        return await _io.to_thread_finished(self.register_many, tensors, undo=self.release)

    def _use_all(self, tensors: Sequence[torch.Tensor]) -> tuple[list[Key], dict[str, dict[Key, tuple[torch.Tensor, int]]]]:
        """Take a use of each tensor's storage that is registered; return every tensor's key
        and, by memory type, the storages that are not (a tensor of each, and its uses)."""
        keys: list[Key] = []
        new: dict[str, dict[Key, tuple[torch.Tensor, int]]] = {}
        with self._lock:
            for t in tensors:
                key = (mem_type(t), dev_index(t), t.untyped_storage().data_ptr())
                keys.append(key)
                reg = self._regs.get(key)
                if reg is not None:
                    if reg.users == 0:
                        reg.batch.live += 1
                    reg.users += 1
                    continue
                items = new.setdefault(key[0], {})
                first, uses = items.get(key, (t, 0))
                items[key] = (first, uses + 1)
        return keys, new

    def release(self, keys: Sequence[Key]) -> None:
        """Drop one use of each key; deregister what nobody uses any more, without waiting."""
        for dlist in self._drop(keys):
            self._agent.call_soon(self._agent.nixl.deregister_memory, dlist)

    def release_now(self, keys: Sequence[Key]) -> None:
        """`release`, deregistering on this thread (blocking: takes the agent)."""
        for dlist in self._drop(keys):
            self._agent.locked(self._agent.nixl.deregister_memory, dlist)

    def regions(self, keys: Sequence[Key]) -> dict[str, list[tuple[int, int, int, str]]]:
        """Return the registered regions of `keys` by memory type, DRAM first."""
        by_mem: dict[str, list[tuple[int, int, int, str]]] = {"DRAM": []}
        with self._lock:
            for key in dict.fromkeys(keys):
                reg = self._regs[key]
                by_mem.setdefault(reg.mem_type, []).append((*reg.region, ""))
        return by_mem

    def _add(self, dlist: Any, items: dict[Key, tuple[torch.Tensor, int]]) -> None:
        """Put one call's registration (`dlist`, of `items`' storages) in the table."""
        batch = _Batch(dlist, [])
        spare = []
        with self._lock:
            self.made += len(items)
            for key, (t, uses) in items.items():
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                reg = self._regs.get(key)
                if reg is not None:  # another thread registered it meanwhile: ours goes with our list
                    if reg.users == 0:
                        reg.batch.live += 1
                    reg.users += uses
                    spare.append(whole)
                    self.dropped += 1
                    continue
                self._regs[key] = _Registration(batch, whole, _region(t), key[0], uses)
                batch.keys.append(key)
                batch.live += 1
            batch.keep = tuple(spare)
            gone = not batch.keys
        if gone:
            self._agent.call_soon(self._agent.nixl.deregister_memory, dlist)

    def _drop(self, keys: Sequence[Key]) -> list[Any]:
        """Drop one use of each key; return the registrations nobody uses any more."""
        gone = []
        with self._lock:
            for key in keys:
                reg = self._regs.get(key)
                if reg is None or reg.users == 0:
                    continue
                reg.users -= 1
                if reg.users == 0:
                    batch = reg.batch
                    batch.live -= 1
                    if batch.live == 0:  # none of its call's storages is used: the list goes
                        for k in batch.keys:
                            del self._regs[k]
                        self.dropped += len(batch.keys)
                        gone.append(batch.dlist)
        return gone


def _regions(items: dict[Key, tuple[torch.Tensor, int]]) -> list[tuple[int, int, int, str]]:
    return [(*_region(t), "") for t, _ in items.values()]


def _region(t: torch.Tensor) -> tuple[int, int, int]:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), dev_index(t))
