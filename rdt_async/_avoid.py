"""Which paths `auto` leaves out for a while, and when a fetch's path counts as unusable.

A fetch whose path cannot be used with its producer (`unusable`: a transport that cannot
serve it here, or one that could not reach the producer before anything moved) goes on
over the next candidate (`_fetch._fetch_over`). A path that could not reach a node at an
address (`Transport.address`; None: the node's) is left out of that node's fetches at
that address for AVOID_S (`avoided`); each fallback is logged once per node and path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ._errors import ObjectFreedError, PeerDiedError, TransferError, TransportUnavailableError
from .transports._base import StillWriting, Unreachable

log = logging.getLogger("rdt_async")

AVOID_S = 300.0  # how long `auto` leaves out a path that could not reach a node


def unusable(exc: BaseException) -> str | None:
    """Why the path a fetch took cannot be used with its producer, or None (the fetch failed).

    A transport that cannot serve the fetch here (not loadable, no room), or one that could
    not reach the producer before anything moved (`Unreachable`: no route, refused, no answer).
    """
    if isinstance(exc, TransportUnavailableError):
        return str(exc)
    if isinstance(exc, (PeerDiedError, ObjectFreedError, StillWriting)) or not isinstance(exc, TransferError):
        return None  # (StillWriting: its into= buffers may change yet, so nothing lands in them again)
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, Unreachable):
            return str(cause)
        cause = cause.__cause__
    return None


class Avoided:
    """(producer's node, transport, address) -> until when (time.monotonic) `auto` leaves
    that path out for that node's objects at that address (None: all of them); and the
    fallbacks already logged. `_lock` guards both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[tuple[str, str, str | None], float] = {}
        self._warned: set[tuple[str, str]] = set()

    def any(self) -> bool:
        """Whether any path is left out now for some node (a fetch then asks `of`)."""
        return bool(self._until)

    def of(self, node: str) -> frozenset[tuple[str, str | None]]:
        """The paths left out for `node`'s objects now, each with the address it could not
        reach (None: any)."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, until in self._until.items() if until <= now]:
                del self._until[key]
            return frozenset((t, a) for (n, t, a) in self._until if n == node)

    def note(self, producer: Any, name: str, exc: BaseException, why: str, address: str | None = None) -> None:
        """Say, once per node and path, that `auto` falls back from `name` for `producer`
        (an `_object.Process`); leave the path out a while where it could not reach the node
        (at `address`: `Transport.address`)."""
        key = (producer.node_id, name, address)
        now = time.monotonic()
        with self._lock:
            if isinstance(exc, TransferError):  # could not reach the node: not this object's doing
                fresh = key not in self._until or self._until[key] <= now
                self._until[key] = now + AVOID_S
            else:
                fresh = key[:2] not in self._warned
                self._warned.add(key[:2])
        if fresh:
            at = "" if address is None else f" at {address}"
            log.warning(
                "rdt_async: auto could not use %s with %s (node %s): %s; fetching over the next path. auto "
                "leaves %s out for that node's objects%s for %g s", name, producer.label, producer.node_id[:12],
                why, name, at, AVOID_S,
            )


avoided = Avoided()
