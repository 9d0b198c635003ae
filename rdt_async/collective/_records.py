"""Group records in Ray's GCS: a name is claimed once in the cluster, and any process
can read who holds which rank. Blocking calls: run them off the loop (`_io.to_thread`).
"""

from __future__ import annotations

import json
from typing import Any

from ray.experimental import internal_kv

KV_NAMESPACE = "rdt_async"


def claim(name: str, record: dict[str, Any]) -> bool:
    """Claim `name` in the GCS with the group's record; True if it was taken already."""
    blob = json.dumps(record).encode()
    return bool(internal_kv._internal_kv_put(f"group/{name}", blob, overwrite=False, namespace=KV_NAMESPACE))


def record(name: str) -> dict[str, Any] | None:
    """Return the record of group `name` ({"backend", "actors": actor ids by rank}), or None."""
    blob = internal_kv._internal_kv_get(f"group/{name}", namespace=KV_NAMESPACE)
    try:
        found: dict[str, Any] | None = json.loads(blob) if blob is not None else None
        return found
    except ValueError:
        return None


def live_members(rec: dict[str, Any]) -> list[int]:
    """The ranks of a record whose actors Ray does not know as dead."""
    from ray._private import state

    live = []
    for rank, actor_id in enumerate(rec.get("actors", [])):
        info = state.actors(actor_id) or {}
        if info.get("State") != "DEAD":
            live.append(rank)
    return live


def release(name: str) -> None:
    """Free `name` for a new group."""
    internal_kv._internal_kv_del(f"group/{name}", namespace=KV_NAMESPACE)
