"""Transfers in Ray's metrics: what this process holds and fetches, through `ray.util.metrics`.

They appear in Ray's Prometheus endpoint and dashboard next to Ray's own (Prometheus
names carry Ray's `ray_` prefix, and Ray tags each series with the worker and node):

| name | kind | tags | what |
| --- | --- | --- | --- |
| `rdt_objects_held` | gauge | | objects this process's store keeps for consumers |
| `rdt_bytes_held` | gauge | | their bytes |
| `rdt_fetches_total` | counter | transport | fetches that returned tensors |
| `rdt_fetch_bytes_total` | counter | transport | bytes those fetches moved |
| `rdt_fetch_seconds` | histogram | transport | from the fetch's start to its tensors in hand |
| `rdt_fetch_errors_total` | counter | transport, error | fetches that raised (or were cancelled), by type |
| `rdt_subscription_version` | gauge | publisher, publication | the version a subscriber holds (`rdt.subscribe`) |
| `rdt_subscription_lag` | gauge | publisher, publication | versions it was behind the newest when it last asked |
| `rdt_subscription_skipped_total` | counter | publisher, publication | versions it was too slow for |
| `rdt_subscription_apply_seconds` | histogram | publisher, publication | from the publisher's answer to the version in hand |

`transport` is the transport's name where this process knows it (a built-in, or one it
loaded), "local", "relay" or "none", else "other": a ref names its transport, and every
value would be a series Ray keeps. `publisher` is the publishing actor's class name and
`publication` the name it publishes under: keep names stable (not one per run or per
version), for the same reason. Two subscriptions of one process to one name on two actors
of one class share their series.

The caller's thread queues each record (a deque append); the I/O loop hands them to Ray
in batches, 0.1 s after the first of a batch (~12 us a record): `python -m rdt_async.bench
--only metrics` measures the cost, and a 4 KiB pass with them on and off.
Metrics are made on first use in a process connected to Ray; elsewhere (a plain process,
as in the transport contract suite) nothing is recorded. `RDT_METRICS=0` turns them off.
Exporting needs Ray's metrics agent (`pip install "ray[default]"`); without it Ray drops them.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from . import _io
from .transports import _registry

FETCH_SECONDS_BOUNDARIES = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
]


class _Metrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.objects_held = Gauge("rdt_objects_held", "rdt_async objects this process keeps for consumers")
        self.bytes_held = Gauge("rdt_bytes_held", "bytes of the rdt_async objects this process keeps")
        self.fetches = Counter("rdt_fetches_total", "rdt_async fetches that returned tensors",
                               tag_keys=("transport",))
        self.fetch_bytes = Counter("rdt_fetch_bytes_total", "bytes moved by rdt_async fetches",
                                   tag_keys=("transport",))
        self.fetch_seconds = Histogram("rdt_fetch_seconds", "rdt_async fetch latency, start to tensors in hand",
                                       boundaries=FETCH_SECONDS_BOUNDARIES, tag_keys=("transport",))
        self.errors = Counter("rdt_fetch_errors_total", "rdt_async fetches that raised, by error type",
                              tag_keys=("transport", "error"))
        tags = ("publisher", "publication")
        self.sub_version = Gauge("rdt_subscription_version", "the version an rdt_async subscriber holds", tag_keys=tags)
        self.sub_lag = Gauge("rdt_subscription_lag", "versions a subscriber was behind when it last asked", tag_keys=tags)
        self.sub_skipped = Counter("rdt_subscription_skipped_total", "versions a subscriber skipped", tag_keys=tags)
        self.sub_apply = Histogram("rdt_subscription_apply_seconds", "a subscriber's fetch of a version",
                                   boundaries=FETCH_SECONDS_BOUNDARIES, tag_keys=tags)


_lock = threading.Lock()
_made: _Metrics | None = None


def _get() -> _Metrics | None:
    """This process's metrics, made on first use; None when off or not connected to Ray."""
    global _made
    if _made is not None:
        return _made
    if os.environ.get("RDT_METRICS", "1") == "0":
        return None
    import ray

    if not ray.is_initialized():
        return None
    with _lock:
        if _made is None:
            _made = _Metrics()
    return _made


def fetched(transport: str, nbytes: int, seconds: float) -> None:
    """Count a fetch that returned tensors. Runs on: consumer (recorded on the I/O loop)."""
    if _wanted():
        _hand_off(_fetched, _label(transport), nbytes, seconds)


def failed(transport: str, exc: BaseException) -> None:
    """Count a fetch that raised `exc` (cancellation included). Runs on: consumer."""
    if _wanted():
        _hand_off(_failed, _label(transport), type(exc).__name__)


# What a fetch records as its path besides a transport's name (`_fetch`): the producing
# process's own tensors, the node's relay, an object of no tensors.
_PATHS = frozenset({"local", "relay", "none"})


def _label(transport: str) -> str:
    """`transport` as a metric's tag: a name this process knows, else "other" (a name that
    came in a ref from another process, unchecked: each value would be a new series)."""
    return transport if transport in _PATHS or _registry.loaded(transport) else "other"


def held(objects: int, nbytes: int) -> None:
    """Set what this process's store keeps. Runs on: producer."""
    if _wanted():
        _hand_off(_held, objects, nbytes)


def subscribed(publisher: str, publication: str, version: int, lag: int, skipped: int, seconds: float) -> None:
    """Record a version a subscriber took (`publisher`: the publishing actor's class name). Runs on: consumer."""
    if _wanted():
        _hand_off(_subscribed, publisher, publication, version, lag, skipped, seconds)


def _wanted() -> bool:
    return _made is not None or os.environ.get("RDT_METRICS", "1") != "0"


# Records wait here and the I/O loop takes them in batches, FLUSH_S after the first of a
# batch: the caller's thread pays a deque append (and one wake-up of the I/O loop a batch),
# never Ray's recording (or, once, the metrics' creation). Ray exports every few seconds.
# At most MAX_RECORDS wait (a loop that cannot keep up loses the oldest, not memory).
FLUSH_S = 0.1
MAX_RECORDS = 10_000
_records: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque(maxlen=MAX_RECORDS)
_flush_due = False


def _hand_off(fn: Callable[..., None], *args: Any) -> None:
    global _flush_due
    _records.append((fn, args))
    if not _flush_due:
        _flush_due = True
        _io.call_soon(_flush_later)


def _forked() -> None:
    """In a forked child: the parent's records are the parent's, and the flush it had due
    runs on the parent's loop; the child's first record schedules one on its own."""
    global _flush_due
    _records.clear()
    _flush_due = False


os.register_at_fork(after_in_child=_forked)


def _flush_later() -> None:  # on the I/O loop
    _io.io_loop().call_later(FLUSH_S, _flush)


def _flush() -> None:  # on the I/O loop
    global _flush_due
    _flush_due = False  # before draining: a record added meanwhile is drained now or schedules another
    while _records:
        fn, args = _records.popleft()
        try:
            fn(*args)
        except Exception:
            logging.getLogger("rdt_async").exception("rdt_async: recording a metric failed")


def _fetched(transport: str, nbytes: int, seconds: float) -> None:
    m = _get()
    if m is not None:
        tags = {"transport": transport}
        m.fetches.inc(1, tags=tags)
        if nbytes:  # (Ray refuses to add 0: an object of empty tensors)
            m.fetch_bytes.inc(nbytes, tags=tags)
        m.fetch_seconds.observe(seconds, tags=tags)


def _failed(transport: str, error: str) -> None:
    m = _get()
    if m is not None:
        m.errors.inc(1, tags={"transport": transport, "error": error})


def _held(objects: int, nbytes: int) -> None:
    m = _get()
    if m is not None:
        m.objects_held.set(objects)
        m.bytes_held.set(nbytes)


def _subscribed(publisher: str, publication: str, version: int, lag: int, skipped: int, seconds: float) -> None:
    m = _get()
    if m is not None:
        tags = {"publisher": publisher, "publication": publication}
        m.sub_version.set(version, tags=tags)
        m.sub_lag.set(lag, tags=tags)
        if skipped:
            m.sub_skipped.inc(skipped, tags=tags)
        m.sub_apply.observe(seconds, tags=tags)
