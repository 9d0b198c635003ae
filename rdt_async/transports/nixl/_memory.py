"""Memory registered with NIXL: each storage once, refcounted, however many tensors use it.

Views and objects sharing a storage share one registration, and the registration holds
the storage so that registered memory is never freed under NIXL. A producer registers
its tensors' storages for as long as their objects live; a consumer registers its
destinations for the length of one fetch; a user's `rdt.register_memory` holds them
until it is closed (`hold` / `unhold`). Freeing a storage's last user deregisters it
without waiting for the agent. `made` and `dropped` count the storages registered and
deregistered.

The new storages of one call (an object's tensors, a fetch's destinations) are registered
in one call into NIXL, and the storages that lose their last user together (an object
retired, a fetch ended) are deregistered in one: NIXL's deregistration costs time in
proportion to every region registered (52 us a call with 16,000 here), so 16,000 storages
registered and let go one call each took seconds; one call of 16,000 takes milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _io
from ..._errors import BackendError
from ._agent import Agent

# Memory type, device index, the storage's address and size: two storages at one address
# (`from_numpy` of an array and of its first slice, `frombuffer`, DLPack) are two regions
# (the first one's region served the other's tensors past its end: "outside every region").
Key = tuple[str, int, int, int]
_log = logging.getLogger("rdt_async")
RETRY_S = 0.05  # pause before the second call into NIXL of a refused registration
INLINE_MAX = 64  # new CPU storages a fetch registers on the I/O loop (~2-5 us each); more go to the pool


def mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def dev_index(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else t.device.index or 0


@dataclass
class _Registration:
    """One registered storage: who uses it, what keeps it alive."""

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
                self._register(items, mem)
                self._add(items)
                done.add(mem)
        except BaseException:
            self.release_now([k for k in keys if k[0] in done or k not in new.get(k[0], {})])
            raise
        return keys

    def _register(self, items: dict[Key, tuple[torch.Tensor, int]], mem: str) -> None:
        """Register `items` in one call into NIXL, once more after a pause if NIXL refuses.

        NIXL answers a refusal of its backend with a bare NIXL_ERR_BACKEND, and UCX says why
        only at its debug level. Seen once in hundreds of test runs here (a producer's 4 KiB
        tensor, UCX silent, while another test added and removed network devices): one
        refusal costs a pause and a second call, not the user's return. A second refusal is
        the user's to see, with what was asked and how to learn why.
        """
        agent = self._agent
        regions = _regions(items)
        try:
            agent.locked(agent.nixl.register_memory, regions, mem)
            return
        except Exception as exc:
            first = exc
        time.sleep(RETRY_S)
        try:
            agent.locked(agent.nixl.register_memory, regions, mem)
        except Exception as exc:
            size = sum(r[1] for r in regions)
            raise BackendError(
                f"nixl could not register {len(regions)} {mem} region(s) of {size} bytes, twice "
                f"({type(first).__name__}: {first}; then {type(exc).__name__}: {exc}): run with "
                "NIXL_LOG_LEVEL=DEBUG UCX_LOG_LEVEL=debug to see why, or return them over another transport"
            ) from exc
        _log.warning("rdt_async: nixl refused to register %d %s region(s) once (%s); a second call did", len(regions), mem, first)

    async def register_all(self, tensors: Sequence[torch.Tensor]) -> list[Key]:
        """`register_many` from the I/O loop: on it where nothing is new, or a few new storages
        are CPU memory and the agent is free; else in the pool.

        A cancel lets a registration already in the pool end, then releases them all.
        """
        keys, new = self._use_all(tensors)
        if not new:
            return keys
        known = [k for k in keys if k not in new.get(k[0], {})]
        if list(new) == ["DRAM"] and len(new["DRAM"]) <= INLINE_MAX:
            agent = self._agent
            try:
                made = agent.try_call(agent.nixl.register_memory, _regions(new["DRAM"]), "DRAM", busy=None)
            except Exception:
                made = None  # refused: the pool's call tries again (`_register`)
            except BaseException:
                self.release(known)
                raise
            if made is not None:
                self._add(new["DRAM"])
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
                storage = t.untyped_storage()
                key = (mem_type(t), dev_index(t), storage.data_ptr(), storage.nbytes())
                keys.append(key)
                reg = self._regs.get(key)
                if reg is not None:
                    reg.users += 1
                    continue
                items = new.setdefault(key[0], {})
                first, uses = items.get(key, (t, 0))
                items[key] = (first, uses + 1)
        return keys, new

    def release(self, keys: Sequence[Key]) -> None:
        """Drop one use of each key; deregister what nobody uses any more, without waiting."""
        self._deregister_soon(self._drop(keys))

    def release_now(self, keys: Sequence[Key]) -> None:
        """`release`, deregistering on this thread (blocking: takes the agent)."""
        self._deregister_now(self._drop(keys))

    def regions(self, keys: Sequence[Key]) -> dict[str, list[tuple[int, int, int, str]]]:
        """Return the registered regions of `keys` by memory type, DRAM first."""
        by_mem: dict[str, list[tuple[int, int, int, str]]] = {"DRAM": []}
        with self._lock:
            for key in dict.fromkeys(keys):
                reg = self._regs[key]
                by_mem.setdefault(reg.mem_type, []).append((*reg.region, ""))
        return by_mem

    def _add(self, items: dict[Key, tuple[torch.Tensor, int]]) -> None:
        """Put storages just registered (`items`, in one call) in the table."""
        spare = []
        with self._lock:
            self.made += len(items)
            for key, (t, uses) in items.items():
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                reg = self._regs.get(key)
                if reg is None:
                    self._regs[key] = _Registration(whole, _region(t), key[0], uses)
                    continue
                reg.users += uses  # another thread registered it meanwhile: ours goes again
                spare.append((key[0], _region(t), whole))
                self.dropped += 1
        self._deregister_soon(spare)

    def _drop(self, keys: Sequence[Key]) -> list[tuple[str, tuple[int, int, int], torch.Tensor]]:
        """Drop one use of each key; return the storages nobody uses any more (memory type,
        region, what keeps it alive until it is deregistered)."""
        gone = []
        with self._lock:
            for key in keys:
                reg = self._regs.get(key)
                if reg is None:
                    continue
                reg.users -= 1
                if reg.users == 0:
                    del self._regs[key]
                    self.dropped += 1
                    gone.append((reg.mem_type, reg.region, reg.keep))
        return gone

    def _deregister_soon(self, gone: list[tuple[str, tuple[int, int, int], torch.Tensor]]) -> None:
        """Deregister `gone` without waiting: one call into NIXL per memory type."""
        for mem, regions, keep in _by_type(gone):
            self._agent.call_soon(_deregister, self._agent.nixl, mem, regions, keep)

    def _deregister_now(self, gone: list[tuple[str, tuple[int, int, int], torch.Tensor]]) -> None:
        for mem, regions, keep in _by_type(gone):
            self._agent.locked(_deregister, self._agent.nixl, mem, regions, keep)


def _by_type(
    gone: list[tuple[str, tuple[int, int, int], torch.Tensor]],
) -> list[tuple[str, list[tuple[int, int, int, str]], list[torch.Tensor]]]:
    by: dict[str, tuple[list[tuple[int, int, int, str]], list[torch.Tensor]]] = {}
    for mem, region, keep in gone:
        regions, keeps = by.setdefault(mem, ([], []))
        regions.append((*region, ""))
        keeps.append(keep)
    return [(mem, regions, keeps) for mem, (regions, keeps) in by.items()]


def _deregister(nixl: Any, mem: str, regions: list[tuple[int, int, int, str]], keep: list[torch.Tensor]) -> None:
    """Deregister `regions` in one call (`keep` holds their memory until it returns)."""
    nixl.deregister_memory(nixl.get_reg_descs(regions, mem))


def _regions(items: dict[Key, tuple[torch.Tensor, int]]) -> list[tuple[int, int, int, str]]:
    return [(*_region(t), "") for t, _ in items.values()]


def _region(t: torch.Tensor) -> tuple[int, int, int]:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), dev_index(t))
