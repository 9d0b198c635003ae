"""Memory registered with NIXL: each storage once, refcounted, however many tensors use it.

Views and objects sharing a storage share one registration, and the registration holds
the storage so that registered memory is never freed under NIXL. A producer registers
its tensors' storages for as long as their objects live; a consumer registers its
destinations for the length of one fetch; a user's `rdt.register_memory` holds them
until it is closed (`hold` / `unhold`). Freeing a storage's last user deregisters it
without waiting for the agent. `made` and `dropped` count the calls into NIXL.
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
class _Registration:
    """One registered storage: NIXL's descriptor list, who uses it, what keeps it alive."""

    dlist: Any
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
        keys: list[Key] = []
        try:
            for t in tensors:
                keys.append(self.register(t))
        except BaseException:
            self.release_now(keys)
            raise
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
        """Register the storage under `t` (once; refcounted) and return its key.

        Blocking: takes the agent. Runs on: producer (prepare) and consumer (pool).
        """
        key, known = self._use(t)
        if not known:
            agent = self._agent
            self._add(key, t, agent.locked(agent.nixl.register_memory, [(*_region(t), "")], key[0]))
        return key

    def use_known(self, t: torch.Tensor) -> Key | None:
        """Take a use of `t`'s storage if it is registered already (no call into NIXL), else None."""
        key, known = self._use(t)
        return key if known else None

    def register_nowait(self, t: torch.Tensor) -> Key | None:
        """Register from the loop if that needs no wait (known storage, or a free agent)."""
        key, known = self._use(t)
        if known:
            return key
        dlist = self._agent.try_call(self._agent.nixl.register_memory, [(*_region(t), "")], key[0], busy=None)
        if dlist is None:
            return None
        self._add(key, t, dlist)
        return key

    async def register_all(self, tensors: Sequence[torch.Tensor]) -> list[Key]:
        """Register each tensor's storage from the I/O loop, in the pool where it must wait.

        A cancel lets a registration already in the pool end, then releases them all.
        """
        keys: list[Key] = []
        try:
            for t in tensors:
                # Known storages (a user's `rdt.register_memory`) are taken here on any device;
                # a new CPU one too where the agent is free; a new GPU one in the pool.
                key = self.register_nowait(t) if t.device.type == "cpu" else self.use_known(t)
                if key is None:
                    key = await _io.to_thread_finished(self.register, t, undo=lambda k: self.release([k]))
                keys.append(key)
        except BaseException:
            self.release(keys)
            raise
        return keys

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

    def _use(self, t: torch.Tensor) -> tuple[Key, bool]:
        key = (mem_type(t), dev_index(t), t.untyped_storage().data_ptr())
        with self._lock:
            reg = self._regs.get(key)
            if reg is not None:
                reg.users += 1
                return key, True
        return key, False

    def _add(self, key: Key, t: torch.Tensor, dlist: Any) -> None:
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        with self._lock:
            self.made += 1
            reg = self._regs.get(key)
            if reg is None:
                self._regs[key] = _Registration(dlist, whole, _region(t), key[0], 1)
                return
            reg.users += 1  # another thread registered it meanwhile: drop ours
            self.dropped += 1
        self._agent.call_soon(self._agent.nixl.deregister_memory, dlist)

    def _drop(self, keys: Sequence[Key]) -> list[Any]:
        """Drop one use of each key; return the registrations nobody uses any more."""
        gone = []
        with self._lock:
            for key in keys:
                reg = self._regs.get(key)
                if reg is None:
                    continue
                reg.users -= 1
                if reg.users == 0:
                    gone.append(self._regs.pop(key).dlist)
                    self.dropped += 1
        return gone


def _region(t: torch.Tensor) -> tuple[int, int, int]:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), dev_index(t))
