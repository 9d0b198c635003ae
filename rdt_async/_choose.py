"""Which path a fetch takes: `auto`'s choice among what the producer prepared (asked of
the transports' declared capabilities and costs, `transports/_auto.py`), a transport the
consumer named, or a collective group both ends are in.

Runs on: consumer, where a fetch starts (`_fetch`) and where it falls back (`_transfer`). Cheap: no
I/O but a lookup of a transport this process does not know yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _ray
from ._avoid import avoided
from ._errors import PeerDiedError, TransferError, TransportUnavailableError
from ._fetched import fetched
from ._membership import groups
from ._object import RDTObject
from ._produce import loads_here
from .transports import _auto, _registry
from .transports._base import Transport


def choose_transport(
    obj: RDTObject, node_id: str, without: frozenset[str] = frozenset(), fell_back: tuple[tuple[str, str], ...] = ()
) -> tuple[str, Any]:
    """Pick the transport for a fetch of `obj` by a process on `node_id`.

    `auto`: small CPU objects -> inline (the bytes came with the ref); otherwise the
    candidate both ends can use (shm and cuda_ipc on one node, nixl where prepared and
    loadable here, a group both ends are in, the object store) that the cost model of
    transports/_auto.py expects to finish first, leaving out paths that could not reach
    the producer's node lately (`_avoid.avoided`); the choice and its reasons are kept in
    `rdt.store_stats()["auto"]`. A one-sided transport that cannot reach this node
    falls back to object_store. Gloo/NCCL objects go over a group both ends share,
    else object_store. A Ray Client driver (`node_id` is `_ray.NO_NODE`) takes the
    bytes in the ref, else object_store (`_for_client`).
    `without`: prepared transports, or the shared group's backend, `auto` must not pick
    (those that failed this fetch, `fell_back`: each with why). Returns the transport's
    name and the metadata its fetch needs.
    """
    name = obj.transport
    carried = _in_ref(obj.meta) if name == _registry.AUTO and not (without or fell_back or avoided.any()) else None
    if carried is not None:  # a small object: `auto` picks its bytes whatever else it knows
        fetched.choice(obj.obj_id, _auto.in_ref(carried))
        return carried, obj.meta[carried]
    if node_id == _ray.NO_NODE:
        return _for_client(obj, name)
    shared = _shared_group(obj)
    if name == _registry.AUTO:
        left_out = _left_out(obj, shared) if avoided.any() else frozenset()
        if shared is not None and shared[0] in without | left_out:
            shared = None  # the group failed this fetch (or could not reach that node lately): not again
        prepared = frozenset(obj.meta) - {"groups"} - without - left_out
        facts = _auto.Facts(
            nbytes=obj.nbytes,
            gpu=any(not s.device.startswith("cpu") for s in obj.specs),
            same_node=obj.producer.node_id == node_id,
            prepared=prepared,
            loads_here=prepared,  # a guess: checked only if one wins (a check may import)
            group=shared[0] if shared is not None else None,
            node_local=frozenset(n for n in prepared if _reach(n) == "node"),
            in_ref=frozenset(n for n in prepared if _carries_bytes(n)),
        )
        choice = _auto.choose_remembered(facts, loads_here)
        if left_out or fell_back:
            note = f"; {', '.join(sorted(left_out))} left out: could not reach that node lately" if left_out else ""
            choice = dataclasses.replace(choice, why=choice.why + note, fell_back=fell_back)
        fetched.choice(obj.obj_id, choice)
        name = choice.transport
    cls = _registry.transport_class(name)
    if cls.reach == "node" and obj.producer.node_id != node_id:
        return _registry.FALLBACK, None  # (auto never picks one from another node)
    if cls.needs_group:
        if shared is None or shared[0] != name:
            _raise_if_broken(obj)  # a group we share is broken: say so, do not fall back
            return _registry.FALLBACK, None  # the consumer is outside the producer's groups
        return name, shared[1]
    return name, obj.meta.get(name)


def _for_client(obj: RDTObject, name: str) -> tuple[str, Any]:
    """The path of a fetch by a Ray Client driver (`_ray.in_client`), which no transport of
    the cluster's reaches but Ray's object store (through the client server): the bytes in
    the ref where the producer named a transport that carries them, else the object store,
    as for a consumer on another node than a node-local transport's."""
    if name != _registry.AUTO and name in obj.meta and _carries_bytes(name):
        return name, obj.meta[name]
    if name == _registry.AUTO:
        fetched.choice(obj.obj_id, _auto.Choice(_registry.FALLBACK, CLIENT_ONLY))
    return _registry.FALLBACK, None


CLIENT_ONLY = "a Ray Client driver: only Ray's object store reaches it (through the client server)"


def transport_for(obj: RDTObject, node_id: str, asked: str | None = None) -> tuple[Transport[Any], Any]:
    """The transport a fetch of `obj` by a process on `node_id` takes (`auto`'s or the
    producer's choice, or the one the consumer `asked` for), and its metadata.

    Raises: TransportUnavailableError (`asked_transport`); TransferError where the ref
    says a tensor is on a device the transport does not move (no producer returns them
    over it, `Transport.check_tensors`; a ref's `meta` device came back from the object
    store as tensors without bytes).
    """
    name, meta = choose_transport(obj, node_id) if asked is None else asked_transport(obj, asked, node_id)
    transport = _registry.transport(name)
    moves = transport.devices
    for k, spec in enumerate(obj.specs):
        if spec.device.partition(":")[0] not in moves:
            raise TransferError(
                f"object {obj.obj_id}: its tensor {k} is said to be on {spec.device}, which transport "
                f"{transport.name!r} does not move ({', '.join(moves)}): no producer sends that; the ref was altered",
                obj_id=obj.obj_id,
            )
    return transport, meta


def _in_ref(meta: dict[str, Any]) -> str | None:
    """The transport `auto` takes for an object whose bytes came with the ref, else None
    (the first by name, as `_auto.choose` takes it): a 4 KiB fetch skips the cost model."""
    carried = min((n for n in meta if n != "groups" and _carries_bytes(n)), default=None)
    cls = None if carried is None else _registry.known_class(carried)
    return carried if cls is not None and cls.reach == "cluster" and not cls.needs_group else None


def _reach(name: str) -> str:
    """`Transport.reach` of a prepared transport (a name from the ref: only one this process
    knows answers; another is no candidate anyway, as it cannot load here)."""
    cls = _registry.known_class(name)
    return "cluster" if cls is None else cls.reach


def _carries_bytes(name: str) -> bool:
    cls = _registry.known_class(name)
    return cls is not None and cls.carries_bytes


def _left_out(obj: RDTObject, shared: tuple[str, Any] | None = None) -> frozenset[str]:
    """The prepared paths `auto` leaves out for `obj` (and the backend of the group both
    ends share, `shared`): those that could not reach its producer's node lately, at the
    address its metadata names (`Transport.address`)."""
    avoid = avoided.of(obj.producer.node_id)
    out = set()
    for name, meta in [*obj.meta.items(), *([shared] if shared is not None else [])]:
        if (name, None) in avoid:
            out.add(name)
            continue
        cls = _registry.known_class(name) if any(t == name for t, _ in avoid) else None
        if cls is not None and (name, address_of(cls, meta)) in avoid:
            out.add(name)
    return frozenset(out)


def address_of(cls: Any, meta: Any) -> str | None:
    """`cls.address(meta)`, where a transport of yours fails to say: None (the node's)."""
    try:
        address = cls.address(meta)
    except Exception:
        return None
    return address if type(address) is str else None


def asked_transport(obj: RDTObject, asked: str, node_id: str) -> tuple[str, Any]:
    """The transport a consumer asked for (`fetch(x, tensor_transport=...)`) and its metadata,
    if the producer can serve it to this process.

    `auto` chooses among what the producer prepared, as for an object produced with it;
    `object_store` always serves (the producer sends on request; an object kept nowhere
    comes from the bytes in its ref); a group's backend serves
    over a group both ends are in; any other transport must have been prepared by the
    producer (named by the method, `put` or `auto`'s plan).
    Raises: TransportUnavailableError naming what the producer can serve and the fix.
    """
    if asked == _registry.AUTO:
        return choose_transport(dataclasses.replace(obj, transport=_registry.AUTO), node_id)
    if asked == _registry.FALLBACK:
        kept = obj.anchor is not None or (type(obj.eager) is dict and asked in obj.eager)
        carried = None if kept else _in_ref(obj.meta)
        if carried is not None:  # kept nowhere: its object-store copy is the ref, whose bytes came here
            return carried, obj.meta[carried]
        return asked, obj.meta.get(asked)
    where = f"fetch(..., tensor_transport={asked!r}) of {obj.obj_id} (held by {obj.producer.label})"
    cls = _registry.known_class(asked)
    if node_id == _ray.NO_NODE and (cls is None or not cls.carries_bytes):
        raise TransportUnavailableError(
            f"{where}: this process is a Ray Client driver (ray.init('ray://...')), not a process of the cluster, "
            f"so {asked} cannot reach it from the producer; ask for tensor_transport='object_store' (or 'auto', "
            "which takes it here), or fetch inside an actor, where every transport works",
            obj_id=obj.obj_id,
        )
    if cls is not None and cls.needs_group:
        shared = _shared_group(obj)
        if shared is not None and shared[0] == asked:
            return shared
        _raise_if_broken(obj)
        raise TransportUnavailableError(
            f"{where}: this process shares no {asked} group with the producer; create one with "
            f"rdt.create_collective_group([...], backend={asked!r}), or ask for 'object_store'",
            obj_id=obj.obj_id,
        )
    if cls is not None and cls.reach == "node" and obj.producer.node_id != node_id:
        raise TransportUnavailableError(
            f"{where}: {asked} reaches only processes on the producer's node; ask for 'object_store' or 'auto'",
            obj_id=obj.obj_id,
        )
    if asked not in obj.meta or asked == "groups":
        served = sorted({*obj.meta} - {"groups"} | {_registry.FALLBACK})
        raise TransportUnavailableError(
            f"{where}: the producer did not prepare {asked} for this object, so it cannot serve it; it serves "
            f"{', '.join(served)}: ask for one of them, or produce it with tensor_transport={asked!r}",
            obj_id=obj.obj_id,
        )
    return asked, obj.meta[asked]


def _shared_group(obj: RDTObject) -> tuple[str, Any] | None:
    """Return (backend, the backend's metadata) of a usable group both ends are in, or None."""
    theirs = obj.meta.get("groups")
    if not theirs:
        return None
    ours = groups.memberships()
    devices = {s.device.split(":")[0] for s in obj.specs}
    for name, (backend, rank) in theirs.items():
        if name in ours and ours[name][0] == backend:
            cls = _registry.transport_class(backend)
            if devices <= set(cls.devices):
                return backend, cls.group_meta(name, rank)
    return None


def _raise_if_broken(obj: RDTObject) -> None:
    """A group this object's producer and this process share is broken: say why.

    Where a fetch from this producer has ended in its death (the transfer that broke the
    group, most often), or it died on this node, that is what the caller needs to know
    (PeerDiedError: retry elsewhere), not the group's state.
    """
    theirs = obj.meta.get("groups") or {}
    for group in groups.broken():
        if group.name in theirs:
            if _ray.known_lost(obj.producer):
                raise PeerDiedError(
                    f"{group.backend} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died or "
                    f"disconnected; its collective group {group.name!r} is broken ({group.broken})",
                    obj_id=obj.obj_id,
                )
            group.check()
