"""Which paths `auto` leaves out for a while, and when a fetch's path counts as unusable.

A fetch whose path cannot be used with its producer (`unusable`: a transport that cannot
serve it here, or one that could not reach the producer before anything moved) goes on
over the next candidate (`_transfer.fetch_over`). A path that could not reach a node at an
address (`Transport.address`; None: the node's) is left out of that node's fetches at
that address for AVOID_S (`avoided`); one that reached something there that is not the
ref's producer (`Unreachable.lasting` False: tcp's greeting of another token), or that
cannot serve this fetch here, is left out of that fetch only. Each fallback is logged
once per node and path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ._errors import ObjectFreedError, PeerDiedError, TransferError, TransportUnavailableError
from .transports._base import StillWriting, Unreachable

log = logging.getLogger("rdt_async")

AVOID_S = 300.0  # how long `auto` leaves out a path that could not reach a node
WARNED = 1024  # (node, path) pairs whose fallback was logged, remembered at most (the oldest go)


def unusable(exc: BaseException) -> str | None:
    """Why the path a fetch took cannot be used with its producer, or None (the fetch failed).

    A transport that cannot serve the fetch here (not loadable, no room), or one that could
    not reach the producer before anything moved (`Unreachable`: no route, refused, no answer).
    """
    if isinstance(exc, TransportUnavailableError):
        return str(exc)
    cause = _unreachable(exc)
    return None if cause is None else str(cause)


def _unreachable(exc: BaseException) -> Unreachable | None:
    """The `Unreachable` a TransferError was raised from, if any."""
    if isinstance(exc, (PeerDiedError, ObjectFreedError, StillWriting)) or not isinstance(exc, TransferError):
        return None  # (StillWriting: its into= buffers may change yet, so nothing lands in them again)
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, Unreachable):
            return cause
        cause = cause.__cause__
    return None


class Avoided:
    """(producer's node, transport, address) -> until when (time.monotonic) `auto` leaves
    that path out for that node's objects at that address (None: all of them); and the
    fallbacks already logged. `_lock` guards all three tables.

    Cheap however many nodes a crafted ref names: entries are kept in the order they end
    (AVOID_S is one for all) and by node, so a fetch drops the ended ones from the front
    and looks up its own node's; the fallbacks logged are the last WARNED.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: collections.OrderedDict[tuple[str, str, str | None], float] = collections.OrderedDict()
        self._by_node: dict[str, dict[tuple[str, str | None], float]] = {}
        self._warned: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def any(self) -> bool:
        """Whether any path is left out now for some node (a fetch then asks `of`)."""
        return bool(self._until)

    def of(self, node: str) -> frozenset[tuple[str, str | None]]:
        """The paths left out for `node`'s objects now, each with the address it could not
        reach (None: any)."""
        with self._lock:
            self._expire(time.monotonic())
            return frozenset(self._by_node.get(node, ()))

    def clear(self) -> None:
        """Forget every path left out and every fallback logged."""
        with self._lock:
            self._until.clear()
            self._by_node.clear()
            self._warned.clear()

    def _expire(self, now: float) -> None:  # holding _lock
        until = self._until
        while until:
            key, end = next(iter(until.items()))
            if end > now:
                return
            del until[key]
            paths = self._by_node[key[0]]
            del paths[key[1:]]
            if not paths:
                del self._by_node[key[0]]

    def note(self, producer: Any, name: str, exc: BaseException, why: str, address: str | None = None) -> None:
        """Say, once per node and path, that `auto` falls back from `name` for `producer`
        (an `_object.Process`); leave the path out a while where it could not reach the node
        (at `address`: `Transport.address`)."""
        cause = _unreachable(exc)
        lasting = cause is not None and cause.lasting  # could not reach the node: not this object's doing
        node = producer.node_id
        with self._lock:
            now = time.monotonic()  # (taken under the lock: entries join `_until` in the order they end)
            if lasting:
                self._expire(now)
                key = (node, name, address)
                fresh = self._until.pop(key, None) is None
                self._until[key] = until = now + AVOID_S  # (at the end: the last to end)
                self._by_node.setdefault(node, {})[key[1:]] = until
            else:
                fresh = (node, name) not in self._warned
                self._warned[node, name] = None
                self._warned.move_to_end((node, name))
                if len(self._warned) > WARNED:
                    self._warned.popitem(last=False)
        if not fresh:
            return
        if lasting:
            at = "" if address is None else f" at {address}"
            then = f"auto leaves {name} out for that node's objects{at} for {AVOID_S:g} s"
        else:
            then = f"it takes {name} again for the next object (said once per node and path)"
        log.warning(
            "rdt_async: auto could not use %s with %s (node %s): %s; fetching this object over the next path; %s",
            name, producer.label, node[:12], why, then,
        )


avoided = Avoided()
