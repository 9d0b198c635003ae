"""Group records and rendezvous keys in Ray's GCS key-value store (behind Ray's own auth).

A name is claimed once in the cluster (`group/<name>`), and any process can read who
holds which rank. A group's members meet through its rendezvous keys
(`rdv/<name in hex>/<creation>/...`, a `GroupKV` per member): the name is hex-encoded
so that no name reaches into another group's keys (hex has no `/`), and each creation
has its own random part so that a name used again never meets keys left by an earlier
group. The creator deletes them all (`purge`) when the group is destroyed or its
creation fails. Blocking calls: run them off the loop (`_io.to_thread`).
"""

from __future__ import annotations

import json
from typing import Any

from ray.experimental import internal_kv

from .._errors import CollectiveGroupError

KV_NAMESPACE = "rdt_async"


def claim(name: str, record: dict[str, Any]) -> bool:
    """Claim `name` in the GCS with the group's record; True if it was taken already."""
    blob = json.dumps(record).encode()
    return bool(internal_kv._internal_kv_put(f"group/{name}", blob, overwrite=False, namespace=KV_NAMESPACE))


def record(name: str) -> dict[str, Any] | None:
    """Return the record of group `name` ({"backend", "actors": actor ids by rank, "creation"}), or None.

    Raises: CollectiveGroupError if the key holds something else than a record
    `create_collective_group` writes (another program's, or another version's).
    """
    blob = internal_kv._internal_kv_get(f"group/{name}", namespace=KV_NAMESPACE)
    if blob is None:
        return None
    try:
        found = json.loads(blob)
    except ValueError:
        found = None
    if not _well_formed(found):
        raise CollectiveGroupError(
            f"the record of collective group {name!r} in Ray's GCS (namespace {KV_NAMESPACE!r}, key "
            f"'group/{name}') is not one this version of rdt_async writes ({bytes(blob)[:80]!r}); pick another "
            "name, or delete the key if nothing uses it"
        )
    return dict(found)


def _well_formed(found: Any) -> bool:
    if not isinstance(found, dict) or found.get("backend") not in ("gloo", "nccl"):
        return False
    actors, creation = found.get("actors"), found.get("creation")
    return (
        isinstance(creation, str)
        and bool(creation)
        and isinstance(actors, list)
        and bool(actors)
        and all(isinstance(a, str) and _is_hex(a) for a in actors)
        and len(set(actors)) == len(actors)
    )


def _is_hex(text: str) -> bool:
    try:
        return bool(text) and bytes.fromhex(text).hex() == text.lower()
    except ValueError:
        return False


def live_members(rec: dict[str, Any]) -> list[int]:
    """The ranks of a record whose actors Ray does not know as dead.

    An actor the GCS no longer knows counts as dead: it forgets only dead actors (those
    of a job that ended, some minutes after; the oldest beyond its cache of dead ones),
    and a record names only actors that answered the creator's ping (so were known).
    """
    from ray._private import state

    live = []
    for rank, actor_id in enumerate(rec["actors"]):
        info = state.actors(actor_id)
        if info and info.get("State") != "DEAD":
            live.append(rank)
    return live


def release(name: str, creation: str) -> bool:
    """Free `name` for a new group, if its record is still of `creation`; return whether it was.

    (Read, then deleted: the GCS has no delete-if. The window between is one round trip.)
    """
    rec = record(name)
    if rec is None or rec["creation"] != creation:
        return False
    internal_kv._internal_kv_del(f"group/{name}", namespace=KV_NAMESPACE)
    return True


def rendezvous_prefix(name: str) -> str:
    """Where the rendezvous keys of every creation of group `name` live (no other name's are under it)."""
    return f"rdv/{name.encode().hex()}/"


def purge(name: str) -> int:
    """Delete every rendezvous key of group `name`; return how many there were."""
    return int(internal_kv._internal_kv_del(rendezvous_prefix(name), del_by_prefix=True, namespace=KV_NAMESPACE))


class GroupKV:
    """One creation of a group's rendezvous keys, in the GCS (the `KV` of `transports._kvstore`).

    Runs on: member (the thread that makes its process group; NCCL: the one that uses it).
    """

    def __init__(self, name: str, creation: str) -> None:
        self._prefix = f"{rendezvous_prefix(name)}{creation}/"

    def put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        return bool(internal_kv._internal_kv_put(self._prefix + key, value, overwrite, namespace=KV_NAMESPACE))

    def get(self, key: str) -> bytes | None:
        value = internal_kv._internal_kv_get(self._prefix + key, namespace=KV_NAMESPACE)
        return bytes(value) if value is not None else None

    def delete(self, key: str) -> bool:
        return bool(internal_kv._internal_kv_del(self._prefix + key, namespace=KV_NAMESPACE))

    def count(self, prefix: str) -> int:
        return len(internal_kv._internal_kv_list(self._prefix + prefix, namespace=KV_NAMESPACE))
