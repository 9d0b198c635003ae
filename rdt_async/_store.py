"""The process-local store: tensors kept by their producer until every ref is gone."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .transports._base import Transport

log = logging.getLogger("rdt_async")


@dataclass
class StoredObject:
    """What a producer keeps for one object."""

    tensors: list[torch.Tensor]
    # transport -> the metadata it prepared for this object (registrations, segments).
    prepared: dict[Transport[Any], Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Store:
    """Objects this process produced, keyed by object id. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, StoredObject] = {}
        self._holders: dict[int, set[str]] = {}  # id(tensor) -> object ids holding it
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._freed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.fetches: collections.Counter[str] = collections.Counter()

    def add(self, obj_id: str, stored: StoredObject) -> None:
        with self._lock:
            self._objects[obj_id] = stored
            for t in stored.tensors:
                self._holders.setdefault(id(t), set()).add(obj_id)

    def get(self, obj_id: str) -> StoredObject | None:
        with self._lock:
            return self._objects.get(obj_id)

    def was_freed(self, obj_id: str) -> bool:
        with self._lock:
            return obj_id in self._freed

    def mark_freed(self, obj_id: str) -> None:
        """Remember that `obj_id` was freed, so later fetches here fail at once."""
        with self._lock:
            self._freed[obj_id] = None
            while len(self._freed) > 100_000:
                self._freed.popitem(last=False)

    def free(self, obj_id: str) -> bool:
        """Drop an object and release what its transports prepared; False if absent.

        Runs on: producer.
        """
        ready: list[asyncio.Future[None]] = []
        with self._lock:
            stored = self._objects.pop(obj_id, None)
            self._freed[obj_id] = None
            if stored is None:
                return False
            for t in stored.tensors:
                holders = self._holders.get(id(t))
                if holders is None:
                    continue
                holders.discard(obj_id)
                if not holders:
                    del self._holders[id(t)]
                    ready.extend(self._waiters.pop(id(t), ()))
        for transport, meta in stored.prepared.items():
            try:
                transport.garbage_collect(obj_id, meta)
            except Exception:  # never let one transport keep the others' resources
                log.exception("rdt_async: %s could not release object %s", transport.name, obj_id)
        for fut in ready:
            fut.get_loop().call_soon_threadsafe(_set_done, fut)
        return True

    def tensor_freed_future(self, tensor: torch.Tensor) -> asyncio.Future[None]:
        """Return a future on the running loop, done when no object holds `tensor`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if id(tensor) in self._holders:
                self._waiters.setdefault(id(tensor), []).append(fut)
                return fut
        fut.set_result(None)
        return fut

    def stats(self) -> dict[str, Any]:
        with self._lock:
            objects = list(self._objects.values())
            fetches = dict(self.fetches)
        return {
            "objects": len(objects),
            "bytes": sum(o.nbytes for o in objects),
            "tensors": sum(len(o.tensors) for o in objects),
            "fetches": fetches,
        }


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


store = Store()
