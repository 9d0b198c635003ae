"""Every call the core makes into Ray: refs, pings and verdicts, the channel to a producer,
the node, and transports published through Ray's key-value store.

(The anchors' out-of-scope callbacks stay with the lifetime model, in `_object.py`.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import pickle
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.client import ray as _client

from . import _io
from ._errors import PeerDiedError, RDTError, TransferError, translating, unavailable
from ._local import pid_alive
from .transports import _net, _registry

if TYPE_CHECKING:
    import torch

    from ._object import Process, RDTObject

log = logging.getLogger("rdt_async")


def new_session() -> None:
    """A `ray.init` in this process: forget what was cached of the last session."""
    global _nodes_seen
    _node_id.cache_clear()
    hand_node_ip.cache_clear()
    _nodes_seen = (0.0, False)


async def await_ref(ref: Any) -> Any:
    """Await a Ray ObjectRef from any loop."""
    return await asyncio.wrap_future(ref.future())


PING_S = 5.0  # how long a failed fetch waits for a producer that answers at once


# How long it then waits for Ray's verdict on a producer that does not answer (its host
# cut off): Ray declares a node dead after its health checks fail, ~10-60 s by its settings.
VERDICT_S = float(os.environ.get("RDT_PEER_VERDICT_S", "90"))


def died_on_this_node(p: Process) -> bool:
    """Say whether the producer ran on this node and its process is gone (at once, no Ray).
    (A Ray Client driver's objects are of no node: its process id says nothing here.)"""
    return p.node_id == node_id() != NO_NODE and not pid_alive(p.pid)


# Producers a fetch from which ended in PeerDiedError in this process (the most recent few).
_lost: collections.OrderedDict[Process, None] = collections.OrderedDict()
_lost_lock = threading.Lock()
LOST_KEPT = 256


def lost(p: Process) -> None:
    """A fetch from producer `p` ended in PeerDiedError (its death, or its connection's), or
    Ray declared it dead during one: remember it (the last LOST_KEPT), and let the
    transports here let go of what they keep for it (connections, metadata)."""
    with _lost_lock:
        _lost[p] = None
        _lost.move_to_end(p)
        while len(_lost) > LOST_KEPT:
            _lost.popitem(last=False)
    for transport in _registry.created():
        try:
            transport.peer_gone(p.node_id, p.pid)
        except Exception:  # letting go is best effort: the fetch's own error is what counts
            log.warning("rdt_async: %s could not let go of %s", transport.name, p.label, exc_info=True)


def known_lost(p: Process) -> bool:
    """Say whether this process knows `p` is gone, at once: a fetch from it ended in
    PeerDiedError, or it ran on this node and its process is gone."""
    return p in _lost or died_on_this_node(p)


async def producer_died(p: Process, *, timeout: float = PING_S) -> bool:
    """Say whether the producer is known dead, after a fetch from it failed.

    On its node the process id answers at once; else Ray does, for an `rdt.remote`
    actor, through a ping to its `rdt` group (a dead actor fails it in well under a
    second). A producer that does not answer within `timeout` is cut off, or its host
    is: the ping then waits up to VERDICT_S for Ray to declare it dead (its node's
    health checks) or for the answer of a host back on the network. A producer that
    answers, or cannot be asked, counts as alive.
    """
    if died_on_this_node(p):
        return True
    if not p.serves:
        return False
    actor = await p.handle()
    # A live producer answers within `timeout`; a cut-off one is declared dead by Ray
    # within VERDICT_S (its pings fail with ActorUnavailableError meanwhile).
    verdict_by = time.monotonic() + timeout + VERDICT_S
    while (left := verdict_by - time.monotonic()) > 0:
        alive = await _ping(actor, left, p.token)
        if alive is not None:
            return not alive
        await asyncio.sleep(min(0.5, max(0.0, verdict_by - time.monotonic())))  # unreachable for now: ask again
    return False


async def _ping(actor: Any, timeout: float, token: str) -> bool | None:
    """Ping a producer's `rdt` group: True if it answered, False if Ray says it is dead or
    another process answers for it (the actor restarted: the one that held the objects is
    gone), None if neither within `timeout` or it is unreachable for now
    (ActorUnavailableError)."""
    ping = asyncio.ensure_future(await_ref(actor.rdt__ping.remote()))
    try:
        await asyncio.wait({ping}, timeout=timeout)
        if not ping.done():
            return None
        answer = ping.result()
        return answer is None or answer == token  # (None: a producer of an older rdt_async)
    except ray.exceptions.ActorUnavailableError:
        return None
    except ray.exceptions.RayActorError:
        return False
    finally:
        if not ping.done():
            ping.cancel()


WATCH_AFTER_S, WATCH_EVERY_S = 2.0, 1.0  # when a transfer's producer starts being watched, how often


async def watch_producer(p: Process) -> None:
    """Return once the producer is known dead; never while it lives (cancel it when done).

    Runs on: consumer, beside a transfer that has run WATCH_AFTER_S (`watched`): a
    ping a second to its `rdt` group, which Ray fails with ActorDiedError once the actor
    (or its host) is declared dead; an unreachable host's pings fail with
    ActorUnavailableError until then.
    """
    actor = await p.handle()
    while not died_on_this_node(p) and await _ping(actor, 10 * WATCH_EVERY_S, p.token) is not False:  # noqa: ASYNC110  (a remote poll: no event to wait on)
        await asyncio.sleep(WATCH_EVERY_S)


async def watched(fetching: Awaitable[list[torch.Tensor]], obj: RDTObject, name: str) -> list[torch.Tensor]:
    """Await a transfer while watching its producer: one Ray declares dead ends it (PeerDiedError).

    A transport may wait on a peer cut off by a partition far longer than Ray takes to
    declare its host dead (a UCX read over TCP, for one): the watch starts once the
    transfer has run `WATCH_AFTER_S`, and cancels it when the producer is dead.
    """
    if not obj.producer.serves:
        return await fetching
    task = asyncio.ensure_future(fetching)
    watch = None
    try:
        await asyncio.wait({task}, timeout=WATCH_AFTER_S)  # most end here: no watch made
        if not task.done():
            watch = asyncio.ensure_future(watch_producer(obj.producer))
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and watch.exception() is not None:  # the watch failed: no verdict
                log.warning(
                    "rdt_async: could not watch %s during the %s fetch of %s (%r); waiting for the transfer alone",
                    obj.producer.label, name, obj.obj_id, watch.exception(),
                )
                watch = None
                await asyncio.wait({task})
    except asyncio.CancelledError:
        if watch is not None:
            watch.cancel()
        task.cancel()
        await _io.shielded(task)  # the transport lets go of the caller's buffers first, through any cancel
        raise
    cancelled = False
    if not task.done():
        lost(obj.producer)  # first: a transport cuts off what is in flight to it at once (nixl's READs)
        task.cancel()
        cancelled = await _io.shielded(task)
    if watch is not None:
        watch.cancel()
    if cancelled:
        raise asyncio.CancelledError
    if not task.cancelled():
        result: list[torch.Tensor] = task.result()  # done (or failed) before the watch could end it
        return result
    raise PeerDiedError(
        f"{name} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died or its host was cut "
        "off during the transfer (Ray declared it dead)",
        obj_id=obj.obj_id,
    )


async def raise_if_died(obj: RDTObject, name: str, exc: RDTError) -> None:
    """A fetch of `obj` over `name` failed with `exc`: if its producer is dead, that is what
    the caller needs to know (PeerDiedError).

    Transports see a death in their own terms (Gloo: "Connection closed by peer", the
    object store: the object lost); callers branch on PeerDiedError (retry elsewhere)
    versus the rest, so every transport's failure is checked against the producer's life.
    """
    if isinstance(exc, PeerDiedError) or not await producer_died(obj.producer):
        return
    raise died(obj, name, exc) from exc


def died(obj: RDTObject, name: str, exc: RDTError) -> PeerDiedError:
    """The error of a fetch of `obj` over `name` whose producer died (`exc`: how the transport saw it)."""
    return PeerDiedError(
        f"{name} fetch of {obj.obj_id}: the producer ({obj.producer.label}) died ({type(exc).__name__}: {exc})",
        obj_id=obj.obj_id,
    )


class RayChannel:
    """The consumer's line to a producer: an actor call to its `rdt` concurrency group."""

    def __init__(self, obj: RDTObject, transport: str) -> None:
        self._obj, self._transport = obj, transport

    async def request_send(self, request: Any) -> Any:
        obj = self._obj
        with translating(f"{self._transport} fetch of {obj.obj_id}", obj.obj_id):
            eager = obj.eager.get(self._transport) if type(obj.eager) is dict else None
            if eager is not None:
                if not is_ref(eager):  # a ref's fields are input: never await what one names
                    raise TransferError(
                        f"{self._transport} fetch of {obj.obj_id}: the ref's object-store reply is a "
                        f"{type(eager).__name__}, not an ObjectRef; pass refs as rdt_async hands them out",
                        obj_id=obj.obj_id,
                    )
                await _check_reply(obj, eager, self._transport)
                return await await_ref(eager)
            if not obj.producer.serves:
                raise unavailable(
                    self._transport,
                    f"the object was put by {obj.producer.label}, which serves no transfers (it is not an "
                    "rdt.remote actor); put it with tensor_transport='object_store' or fetch it on its node",
                )
            # A cancelled fetch leaves the producer's send to finish and its reply unread:
            # `ray.cancel` of an actor call still queued in this process leaves a hole in
            # the actor's sequence numbers, and an in-order (sync) producer then waits 30 s
            # for it and fails every call queued meanwhile (seen on Ray 2.60 in our tests).
            actor = await obj.producer.handle()
            ref = actor.rdt__send.remote(obj.obj_id, self._transport, request)
            return await await_ref(ref)


# What a reply put with an object holds beyond its tensors' bytes: Ray's and pickle's
# framing (~250 bytes, and ~40 a tensor, on Ray 2.60), with room to spare.
REPLY_SLACK, REPLY_SLACK_PER_TENSOR = 1 << 16, 1 << 10
REPLY_ASK_S = 1.0  # how long the reply's owner is asked its size; past it, the reply is awaited as it stands
_sized: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # replies' sizes their owners said
SIZED = 1024  # ... remembered, the newest


async def _check_reply(obj: RDTObject, reply: Any, transport: str) -> None:
    """Refuse a ref's object-store reply that is not the one put with its tensors, before
    anything is pulled: Ray's owner of it knows no size for it (a task's result, which may
    never be made) or one larger than the ref's tensors need.

    A reply's size is asked once (remembered: every consumer of a node may fetch it). One
    whose owner does not say within REPLY_ASK_S is awaited as it stands: Ray's error (its
    owner died) or the caller's timeout ends the wait.
    """
    key = reply.binary()
    size: Any = _sized.get(key)
    if size is None:
        where = await _io.to_thread(_located, reply, purpose=_io.CALLS)
        if where is None:
            return
        size = where.get("object_size")
        if type(size) is int:
            _sized[key] = size
            while len(_sized) > SIZED:
                _sized.popitem(last=False)
    most = obj.nbytes + REPLY_SLACK + REPLY_SLACK_PER_TENSOR * len(obj.specs)
    if type(size) is not int or size > most:
        said = "an object not made yet (a task's result)" if size is None else f"{size} bytes"
        raise TransferError(
            f"{transport} fetch of {obj.obj_id}: the ref's object-store reply is {said}, not the one put with "
            f"its tensors ({obj.nbytes} bytes); nothing was pulled. Pass refs as rdt_async hands them out",
            obj_id=obj.obj_id,
        )


def _located(ref: Any) -> dict[str, Any] | None:
    """What the owner of `ref` says of it (its size), or None where it cannot be asked."""
    from ray.experimental import get_object_locations

    try:
        return get_object_locations([ref], timeout_ms=int(REPLY_ASK_S * 1000)).get(ref)
    except Exception:  # (its owner out of reach, or gone): the wait for the object says why
        return None


def is_ref(x: Any) -> bool:
    return isinstance(x, ray.ObjectRef)


def is_actor_handle(x: Any) -> bool:
    """Say whether `x` is an actor's handle: an ActorHandle, or in a Ray Client driver a
    ClientActorHandle (which calls the actor through the client server)."""
    if isinstance(x, ray.actor.ActorHandle):
        return True
    if not in_client():
        return False
    from ray.util.client.common import ClientActorHandle

    return isinstance(x, ClientActorHandle)


# The node of a Ray Client driver (`ray.init("ray://...")`): Ray's nil node id, which no
# node has. The client is no process of the cluster (Ray's runtime context there answers
# for the client server's node), so no producer is on its node.
NO_NODE = "ff" * 28


def in_client() -> bool:
    """Say whether this process drives the cluster through Ray Client (`ray.init("ray://...")`).

    Such a driver is no process of the cluster: nothing of the cluster can reach it (no
    node, no address a producer can trust), and it calls Ray through the client server.
    Its fetches go through Ray's object store (`_choose`), its puts too (`_produce`).
    """
    return bool(_client.is_connected())


def node_id() -> str:
    """This process's node (NO_NODE in a Ray Client driver)."""
    return NO_NODE if in_client() else _node_id()


@functools.lru_cache(maxsize=1)
def _node_id() -> str:
    """A cluster process's node (cached; a new session clears it)."""
    return ray.get_runtime_context().get_node_id()


def actor_handle(state: bytes) -> Any:
    """The ActorHandle whose pickle is `state` (an `rdt.remote` producer's, `_object.Process`).

    A Ray Client driver cannot unpickle one (its Ray has no core worker): the client server
    does, as it unpickles every value put from the client, and sends it back as a
    ClientActorHandle, which calls the actor through the server. Blocking (two round trips).
    Keep it for the session (`_object._handles` does): one dropped makes the server let go
    of its handle to the actor for this client, also the one of an actor the client made.
    """
    if not in_client():
        return pickle.loads(state)
    return ray.get(ray.put(_Pickled(state)))


def actor_id_of(handle: Any) -> str | None:
    """The id (hex) of the actor `handle` calls (`actor_handle`'s), or None for another object."""
    if in_client():
        from ray.util.client.common import ClientActorHandle

        # (its `_actor_id`: an attribute other than its own asks the client server for the class)
        actor = handle._actor_id if isinstance(handle, ClientActorHandle) else None
    else:
        actor = getattr(handle, "_ray_actor_id", None)
    hex_id = getattr(actor, "hex", None)
    return hex_id() if hex_id is not None else None


class _Pickled:
    """Bytes a `pickle.loads` in the process that unpickles this makes into their object."""

    def __init__(self, state: bytes) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.state,)


@functools.lru_cache(maxsize=1)
def hand_node_ip() -> None:
    """Tell the transports the address Ray knows this node by: what their listeners
    advertise to other nodes (`transports/_net.py`), and how to ask the other nodes'
    (UCX keeps to the interfaces that reach them). Once per session; before a listener opens."""
    if not ray.is_initialized():
        _net.set_node_ip(None)
        return
    _net.set_node_ip(ray.util.get_node_ip_address(), _node_ips)


def _node_ips() -> list[str]:
    """The addresses Ray knows the cluster's alive nodes by (asked of the GCS)."""
    return [str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]


def get_ref(ref: Any, timeout: float | None) -> Any:
    return ray.get(ref, timeout=timeout)


def free_remote(obj: RDTObject) -> None:
    """Ask the producer to free `obj` now (fire and forget; never blocks)."""
    if not obj.producer.serves:
        raise RDTError(
            f"object {obj.obj_id} was put by {obj.producer.label}: call rdt.free() there",
            obj_id=obj.obj_id,
        )
    obj.producer.call_soon(lambda actor: actor.rdt__free.remote(obj.obj_id))


def put(value: Any) -> Any:
    """Return an ObjectRef to `value`, owned by this process (an RDTObject: with its anchor)."""
    return ray.put(value)


_nodes_seen: tuple[float, bool] = (0.0, False)


def several_nodes() -> bool:
    """Say whether the cluster has more than one alive node (asked of the GCS every 5 s)."""
    global _nodes_seen
    checked, several = _nodes_seen
    if time.monotonic() - checked > 5.0:
        several = len([n for n in ray.nodes() if n.get("Alive")]) > 1
        _nodes_seen = (time.monotonic(), several)
    return several


# Transports registered in one process reach every other one through Ray's GCS key-value
# store: `rdt.register_transport` publishes (name, devices, class) there, now or at the
# next `ray.init()`, and a lookup miss in any process reads it back (the registry's
# cluster hooks). Classes from user code (a script, a test module) travel by value.
_KV_NAMESPACE = "rdt_async"


_published: dict[str, tuple[bytes, bool]] = {}  # name -> (pickled registration, class says `auto_prepares`)


def _kv_key(name: str) -> bytes:
    return f"transport:{name}".encode()


def _auto_key(name: str) -> bytes:
    return f"auto:{name}".encode()


def _kv_ready() -> bool:
    from ray.experimental import internal_kv

    return ray.is_initialized() and internal_kv._internal_kv_initialized()


def _publish_transport(reg: _registry.Registration) -> None:
    """Publish a registration for the cluster. Raises: TypeError if it cannot be pickled."""
    _published[reg.name] = (_pickle_transport(reg), bool(getattr(reg.cls, "auto_prepares", False)))
    hooks = ray._private.worker._post_init_hooks
    if _publish_all not in hooks:
        hooks.append(_publish_all)
    if _kv_ready():
        _publish_all()


def _publish_all() -> None:
    from ray.experimental import internal_kv

    for name, (blob, for_auto) in list(_published.items()):
        internal_kv._internal_kv_put(_kv_key(name), blob, overwrite=True, namespace=_KV_NAMESPACE)
        if for_auto:  # a mark the processes' `auto` list (`_auto_names`)
            internal_kv._internal_kv_put(_auto_key(name), b"1", overwrite=True, namespace=_KV_NAMESPACE)
        else:
            internal_kv._internal_kv_del(_auto_key(name), namespace=_KV_NAMESPACE)


def _pickle_transport(reg: _registry.Registration) -> bytes:
    import sys

    from ray import cloudpickle

    module = sys.modules.get(reg.cls.__module__)
    if module is not None and _is_user_code(module) and not cloudpickle.cloudpickle._is_registered_pickle_by_value(module):
        # For good: the metadata its objects carry comes from the same module.
        cloudpickle.register_pickle_by_value(module)
    try:
        blob: bytes = cloudpickle.dumps((reg.name, reg.devices, reg.cls))
        return blob
    except Exception as exc:
        raise TypeError(
            f"transport class {reg.cls.__qualname__} cannot be pickled to reach other processes: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _is_user_code(module: Any) -> bool:
    """Say whether `module` is a file of the user's (not installed, not rdt_async, not __main__)."""
    path = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not path:
        return False
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    ours = os.path.dirname(os.path.realpath(__file__)) + os.sep  # rdt_async/
    return "site-packages" not in parts and "dist-packages" not in parts and not path.startswith(ours)


def _resolve_transport(name: str) -> tuple[Sequence[str], type] | None:
    """Return (devices, class) published for `name` by some process, or None."""
    if not _kv_ready():
        return None
    from ray import cloudpickle
    from ray.experimental import internal_kv

    blob = internal_kv._internal_kv_get(_kv_key(name), namespace=_KV_NAMESPACE)
    if blob is None:
        return None
    _, devices, cls = cloudpickle.loads(blob)
    return devices, cls


def _auto_names() -> list[str]:
    """Names of the transports published in this cluster whose class says `auto_prepares`
    (none before ray.init): what every process's `auto` may prepare objects for."""
    if not _kv_ready():
        return []
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(_auto_key(""), namespace=_KV_NAMESPACE)
    return sorted(k.decode(errors="replace").partition(":")[2] for k in keys)


_registry.set_cluster_hooks(resolve=_resolve_transport, publish=_publish_transport, listing=_auto_names)


def warm_serialization() -> None:
    """Make this process's Ray serialization context now (blocking; at an actor's creation).

    Ray makes it at the process's first put or get of an object, importing pydantic's v1
    shim on the way: ~0.1 s with the GIL held. The first object an actor makes (its
    anchor's `ray.put`, in a pool thread) would stall the actor's loop that long.
    """
    with contextlib.suppress(Exception):  # a private API: its absence costs only that stall
        ray._private.worker.global_worker.get_serialization_context()
