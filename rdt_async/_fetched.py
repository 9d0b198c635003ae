"""What this process's fetches did, for `rdt.store_stats()`: how many went over each
transport, and the last choices `auto` made (transports/_auto.py) with their reasons.

The consumer's record, apart from the producer's store (`_store`): fetches count here
from any thread, under a lock of their own.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

log = logging.getLogger("rdt_async")

CHOICES_KEPT = 32  # the last choices `auto` made, kept for `stats`


class Fetched:
    """Counts of fetches by transport, and `auto`'s last choices; `_lock` guards both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._choices: collections.deque[tuple[str, Any]] = collections.deque(maxlen=CHOICES_KEPT)

    def count(self, transport: str) -> None:
        """Count one fetch that went over `transport`."""
        with self._lock:
            self._counts[transport] += 1

    def choice(self, obj_id: str, choice: Any) -> None:
        """Keep what `auto` picked for a fetch of `obj_id` (an `_auto.Choice`), and why."""
        with self._lock:
            self._choices.append((obj_id, choice))  # said as a dict when asked (`stats`)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rdt_async: auto picked %s for %s: %s", choice.transport, obj_id, choice.why)

    def stats(self) -> dict[str, Any]:
        """`fetches` (by transport) and `auto` (the last choices, newest last)."""
        with self._lock:
            counts, choices = dict(self._counts), list(self._choices)
        return {"fetches": counts, "auto": [{"obj_id": obj_id, **c.as_dict()} for obj_id, c in choices]}


fetched = Fetched()
