"""A `torch.distributed.Store` over a key-value service handed in: the rendezvous of a group.

Gloo's and NCCL's process groups meet through a store: each rank `set`s its address (Gloo)
or rank 0 its communicator's unique id (NCCL, once per communicator, lazily), and the
others `wait` for and `get` them. torch's own `TCPStore` is a server on an open port
that anyone who reaches it may read and write; `KVStore` instead keeps the keys in a
service the caller trusts (for collective groups: Ray's GCS key-value store, behind
Ray's own authentication), handed in as a `KV`. It never imports Ray.

What torch calls (its `PythonStore` trampoline): `set`, `get`, `wait` (Gloo's full mesh:
one `set` per rank, then `wait` + `get` of every rank's key), and where a backend needs
them `add`, `compare_set`, `check`, `delete_key`, `num_keys`, `clone`. The KV has no
push: `get` and `wait` poll it with backoff, in the calling thread (the one that makes
the process group, never a loop's; NCCL: the one that first uses a pair), until the keys
appear, the timeout passes, or the store is closed (the group was torn down meanwhile).
Runs on: member.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

POLL_FIRST_S = 0.0005  # first pause between polls of the KV ...
POLL_CAP_S = 0.02  # ... doubling up to this (a GCS round trip is ~0.3-1 ms)


class KV(Protocol):
    """A key-value service the store keeps its keys in (keys are the store's own, already scoped)."""

    def put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        """Write `value` (not over an existing key unless `overwrite`); return whether the key existed."""
        ...

    def get(self, key: str) -> bytes | None:
        """Return the value of `key`, or None if there is none."""
        ...

    def delete(self, key: str) -> bool:
        """Delete `key`; return whether it existed."""
        ...

    def count(self, prefix: str) -> int:
        """Return how many keys start with `prefix`."""
        ...


class StoreClosedError(RuntimeError):
    """The store was closed while a call waited on it (its group is being torn down)."""


class KVStore(dist.Store):  # type: ignore[misc,name-defined]  # torch's pybind class, untyped
    """torch's Store interface over `kv`, for one group's rendezvous; `close()` ends its waits."""

    def __init__(self, kv: KV, timeout_s: float, what: str, closed: threading.Event | None = None) -> None:
        if not timeout_s > 0:  # (a wait that torch bounds by 0 is unbounded: never the default)
            raise ValueError(f"{what}: a store's waits are bounded by a timeout over 0 s, not {timeout_s!r}")
        super().__init__()
        self._kv, self._timeout_s, self._what = kv, timeout_s, what
        self._closed = closed or threading.Event()
        self._seen: dict[str, bytes] = {}  # values `wait` found, for the `get` that follows it
        self._seen_lock = threading.Lock()
        self._writes = threading.Lock()  # a write and `close` never overlap

    def close(self) -> None:
        """End every wait on this store (and its clones) now, with StoreClosedError.

        Returns once no write is under way: none follows, so the caller may delete the keys.
        """
        with self._writes:
            self._closed.set()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (on this store or a clone)."""
        return self._closed.is_set()

    def _put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        with self._writes:
            if self._closed.is_set():
                raise StoreClosedError(f"{self._what}: the group was torn down")
            return self._kv.put(key, value, overwrite=overwrite)

    # -- torch's Store interface (called from C++, with the GIL) --

    def set(self, key: str, value: bytes) -> None:
        self._put(_key(key), bytes(value))

    def get(self, key: str) -> bytes:
        with self._seen_lock:
            value = self._seen.pop(key, None)
        if value is not None:
            return value
        return self._await([key], self._timeout_s)[0]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        values = self._await(keys, self._timeout_s if timeout is None else timeout.total_seconds())
        with self._seen_lock:
            self._seen.update(zip(keys, values))

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._kv.get(_key(k)) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._locked(key):
            now = int(self._kv.get(_key(key)) or b"0") + amount
            self._put(_key(key), str(now).encode())
        return now

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked(key):
            current = self._kv.get(_key(key))
            if (current is None and not expected) or current == bytes(expected):
                self._put(_key(key), bytes(desired))
                return bytes(desired)
            return current if current is not None else bytes(expected)

    def delete_key(self, key: str) -> bool:
        return self._kv.delete(_key(key))

    def num_keys(self) -> int:
        return self._kv.count(_KEYS)

    def clone(self) -> KVStore:
        return KVStore(self._kv, self._timeout_s, self._what, self._closed)

    # -- polling --

    def _await(self, keys: Sequence[str], timeout_s: float) -> list[bytes]:
        """Poll the KV until every key has a value; return them in order.

        Raises: StoreClosedError if the store is closed meanwhile; TimeoutError after
        `timeout_s` (0: no limit, as torch's kNoTimeout), naming the keys still missing.
        """
        found: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
        pause = POLL_FIRST_S
        while True:
            for k in keys:
                if k not in found:
                    value = self._kv.get(_key(k))
                    if value is not None:
                        found[k] = value
            if len(found) == len(keys):
                return [found[k] for k in keys]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k in keys if k not in found]
                raise TimeoutError(
                    f"{self._what}: waited {timeout_s:.0f} s for the other members' keys {missing} "
                    "(did a member fail to join?)"
                )
            if self._closed.wait(min(pause, left)):  # a pause that a close ends at once
                raise StoreClosedError(f"{self._what}: the group was torn down while this member joined it")
            pause = min(pause * 2, POLL_CAP_S)

    def _locked(self, key: str) -> _KVLock:
        return _KVLock(self, key)


class _KVLock:
    """A lock on one key, kept in the KV itself (put-if-absent), for `add` and `compare_set`."""

    def __init__(self, store: KVStore, key: str) -> None:
        self._store, self._lock = store, _LOCKS + key

    def __enter__(self) -> None:
        pause = POLL_FIRST_S
        deadline = time.monotonic() + self._store._timeout_s
        while self._store._put(self._lock, b"1", overwrite=False):  # True: someone holds it
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._store._what}: a key stayed locked for {self._store._timeout_s:.0f} s")
            if self._store._closed.wait(pause):
                raise StoreClosedError(f"{self._store._what}: the group was torn down")
            pause = min(pause * 2, POLL_CAP_S)

    def __exit__(self, *exc: Any) -> None:
        self._store._kv.delete(self._lock)


_KEYS, _LOCKS = "k/", "l/"  # torch's keys, and the locks of add/compare_set, apart


def _key(key: str) -> str:
    return _KEYS + key
