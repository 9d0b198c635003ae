"""RDTObject, the anchor lifetime, and the producer's side of an object.

Lifetime: every object with tensors carries an *anchor*, a tiny object this process
owns (a return of its own `rdt__anchors` method in an `rdt.remote` actor, else a
`ray.put`), with Ray's out-of-scope callback registered on it. The RDTObject holds the
anchor's ref, so Ray's distributed reference counting keeps the anchor alive while
any ref to the RDTObject, or any deserialized copy of it, exists anywhere. When the
last one goes, the callback frees the tensors here. The producer never keeps the
anchor itself.

`auto` and GPUs: a GPU object is exported for cuda_ipc (same-node consumers map it and
copy once, device to device) where this process's memory can be exported, and prepared
for nixl (other nodes) whenever this process can load it; else it goes through the
object store. A CPU object stays inline when small, and
is exported to shm for same-node consumers; from AUTO_NIXL_MIN_BYTES on, and only
where nixl loads and the cluster has more than one node, it is registered with NIXL as well, so that consumers on other
nodes read it one-sidedly instead of through the object store. Below that size
NIXL's costs (one agent per process, a registration per storage, ~0.6 KB of
metadata in every ref) buy nothing worth the hot path. The consumer picks: inline,
then shm or cuda_ipc on the producer's node, then nixl if it can load nixl, then object_store.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import functools
import os
import pickle
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from . import _cuda, _io, _tree
from ._errors import ObjectFreedError, RDTError, TransportUnavailableError, translating
from ._store import StoredObject, log, store
from .transports import _auto, _registry
from .transports._base import TensorSpec, Transport, pid_alive
from .transports.inline import AUTO_MAX_BYTES as INLINE_AUTO_MAX_BYTES

if not hasattr(ray._raylet.CoreWorker, "add_object_out_of_scope_callback"):
    raise ImportError(
        f"rdt_async needs Ray's out-of-scope callbacks (Ray >= 2.60); this is Ray {ray.__version__}. "
        "Upgrade with: pip install 'ray>=2.60,<3'"
    )


@dataclass(frozen=True)
class Process:
    """Where an object lives: node, process token, and the actor serving it (if any).

    The actor's handle travels as pickled bytes and is rebuilt once per process on
    first use: an ActorHandle in every RDTObject would cost each deserialization of
    every ref a few hundred microseconds, and most fetches never call the producer.
    """

    node_id: str
    token: str
    actor_id: str | None = None
    actor_state: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def actor(self) -> Any:
        """The producer's ActorHandle, or None for the driver and tasks."""
        if self.actor_state is None:
            return None
        handle = _handles.get(self.token)
        if handle is None:
            handle = _handles[self.token] = pickle.loads(self.actor_state)
        return handle

    @property
    def label(self) -> str:
        if self.actor_id is None:
            return f"driver/process {self.token.split(':')[0]}"
        return f"actor {self.actor_id[:8]}"


_handles: dict[str, Any] = {}  # process token -> ActorHandle rebuilt in this process


@functools.lru_cache(maxsize=1)
def _token_for(pid: int) -> str:
    return f"{pid}:{secrets.token_hex(6)}"


def here() -> Process:
    """Return this process's identity (Ray must be initialized)."""
    ctx = ray.get_runtime_context()
    if ctx.worker.mode == ray.WORKER_MODE and ctx.get_actor_id() is not None:
        actor_id, state = _current_actor()
        return Process(ctx.get_node_id(), _token_for(os.getpid()), actor_id, state)
    return Process(ctx.get_node_id(), _token_for(os.getpid()))


@functools.lru_cache(maxsize=1)
def _current_actor() -> tuple[str, bytes]:
    """This actor's id and its handle pickled out of band (made once per process)."""
    handle = ray.get_runtime_context().current_actor
    return handle._ray_actor_id.hex(), pickle.dumps(handle)


@dataclass(frozen=True, repr=False)
class RDTObject:
    """A value whose tensors stay with their producer until fetched.

    Fetch it with ``await rdt.fetch(obj)`` (or ``rdt.get(obj)`` in sync code). Methods of
    `rdt.remote` actors receive top-level RDTObject arguments already fetched.
    """

    obj_id: str
    producer: Process
    transport: str
    specs: tuple[TensorSpec, ...]
    skeleton: Any
    meta: dict[str, Any]
    # Replies of two-sided transports made at creation, for producers with no `rdt` group.
    eager: dict[str, Any]
    anchor: Any  # ray.ObjectRef | None: keeps the tensors alive, see module docstring

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def __repr__(self) -> str:
        shown = ", ".join(str(s) for s in self.specs[:4]) + (", ..." if len(self.specs) > 4 else "")
        return (
            f"RDTObject({self.obj_id[:12]}, {len(self.specs)} tensor(s) [{shown}], "
            f"{self.nbytes} bytes, transport={self.transport}, held by {self.producer.label}; "
            "get the value with `await rdt.fetch(obj)` or `rdt.get(obj)`)"
        )


class _Anchors:
    """A pool of pre-made anchors, so that making one stays off the producer's hot path.

    In an `rdt.remote` actor the anchors are the returns of one call to its own
    `rdt__anchors` method (its `rdt` group): 32 owned refs for ~1.6 ms, inlined in this
    process's memory store. A `ray.put` goes through plasma and costs ~0.55 ms of CPU
    each, which the driver and plain actors still pay.
    """

    LOW, BATCH = 8, 32
    WAIT_S = 30.0  # for the own-method call; an actor that cannot answer is going away

    def __init__(self) -> None:
        self._pool: list[Any] = []
        self._lock = threading.Lock()
        self._refilling = False
        self._session = 0  # which `ray.init` of this process the pool's refs belong to
        # Refs of ended sessions, kept for good: a new session reuses object ids, and
        # dropping an old ref would release the new object of the same id.
        self._ended: list[Any] = []
        self._closed = False  # the interpreter is exiting: make no more

    def new_session(self) -> None:
        """A `ray.init` in this process: anchors made for the last session are void."""
        with self._lock:
            self._ended.extend(self._pool)
            self._pool = []
            self._session += 1

    def close(self) -> None:
        """At exit, before Ray's own shutdown: no refill may start Ray again."""
        with self._lock:
            self._closed = True

    def take(self, obj_id: str) -> Any:
        with self._lock:
            anchor = self._pool.pop() if self._pool else None
            refill = len(self._pool) < self.LOW and not self._refilling and not self._closed
            self._refilling = self._refilling or refill
            session = self._session
        if anchor is None:
            anchor = ray.put(None)
        if refill:
            _io.pool().submit(self._refill, session)
        cw = ray._private.worker.global_worker.core_worker
        if not cw.add_object_out_of_scope_callback(anchor, functools.partial(_on_anchor_gone, obj_id)):
            _on_anchor_gone(obj_id, b"")
        return anchor

    def _refill(self, session: int) -> None:
        try:
            fresh = self._make(self.BATCH, session)
            with self._lock:
                (self._pool if session == self._session else self._ended).extend(fresh)
        except Exception:  # Ray shut down meanwhile: the pool stays small, take() still works
            pass
        finally:
            self._refilling = False

    def _live(self, session: int) -> bool:
        return session == self._session and not self._closed and ray.is_initialized()

    def _make(self, n: int, session: int) -> list[Any]:
        actor = _anchor_source()
        if actor is None:
            out = []
            for _ in range(n):
                if not self._live(session):
                    break  # never start Ray (ray.put would), never put into the next session
                out.append(ray._private.worker.put(None))  # the put that does not start Ray
            return out
        if not self._live(session):
            return []
        refs = actor.rdt__anchors.options(num_returns=n).remote(n)
        ready, _ = ray.wait(refs, num_returns=n, timeout=self.WAIT_S, fetch_local=False)
        return refs if len(ready) == n else []


@functools.lru_cache(maxsize=1)
def _anchor_source() -> Any:
    """This process's actor handle if it serves `rdt__anchors` (an `rdt.remote` actor), else None."""
    actor = here().actor
    return actor if actor is not None and hasattr(actor, "rdt__anchors") else None


_anchors = _Anchors()


def _on_ray_init() -> None:
    """Ray's post-init hook: each `ray.init` of this process (a driver) starts a session.

    What the last session left is void: its objects can no longer be fetched (their refs
    and anchors died with it, their out-of-scope callbacks will never run), so they are
    freed; cached identities (node, actor handles) are forgotten.
    """
    _anchors.new_session()
    for obj_id in store.object_ids():
        store.free(obj_id)
    _anchor_source.cache_clear()
    node_id.cache_clear()
    _handles.clear()
    global _nodes_seen
    _nodes_seen = (0.0, False)


def _at_exit() -> None:
    _anchors.close()


if _on_ray_init not in ray._private.worker._post_init_hooks:
    ray._private.worker._post_init_hooks.append(_on_ray_init)
atexit.register(_at_exit)  # atexit runs last-registered first: before Ray's shutdown


def _on_anchor_gone(obj_id: str, _oid: bytes) -> None:
    # Runs on a Ray thread: O(1), hand the work to the I/O loop.
    _io.call_soon(_free_quietly, obj_id)


def _free_quietly(obj_id: str) -> None:
    if store.free(obj_id, last_ref=True):
        log.debug("rdt_async: freed %s (last ref gone)", obj_id)


def _prepared_transports(name: str, tensors: Sequence[torch.Tensor]) -> list[Transport[Any]]:
    """Transports to prepare at return time for a method asking for `name`."""
    if name != _registry.AUTO:
        transport = _registry.get(name)
        transport.check_tensors(tensors)
        if name in ("gloo", "nccl") and not any(b == name for b, _ in _memberships().values()):
            raise unavailable(
                name,
                f"this process is in no {name} group, so every fetch would go through the object "
                f"store: create one first, rdt.create_collective_group(actors, backend={name!r}), "
                "or return with tensor_transport='auto'",
            )
        return [transport]
    _registry.get("object_store").check_tensors(tensors)  # what auto falls back to
    if all(t.device.type == "cpu" for t in tensors):
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes <= INLINE_AUTO_MAX_BYTES:
            return [_registry.get("inline")]  # small: the bytes ride in the ref
        plan = [_registry.get("shm")]  # same node, CPU: the likely consumer
        if nbytes >= AUTO_NIXL_MIN_BYTES and _loads_here("nixl") and _several_nodes():
            plan.append(_registry.get("nixl"))  # for consumers on other nodes (UCX listens then)
        return plan
    plan = [_registry.get("cuda_ipc")] if _cuda_ipc_here() else []  # GPU, same node: mapped, one copy
    if _loads_here("nixl"):
        plan.append(_registry.get("nixl"))  # GPU, other nodes (and the same one without cuda_ipc)
    return plan  # nothing: object_store


# Auto prepares nixl for CPU objects only from this size on: registering costs ~0.1 ms
# plus ~0.5 s once per process for the agent, and at this size the producer already
# exports off its loop (Transport.inline_prepare_bytes), so the small-object hot path
# never touches NIXL. Smaller objects that cross nodes go through the object store.
AUTO_NIXL_MIN_BYTES = 1 << 20


@functools.cache
def _loads_here(name: str) -> bool:
    """Say whether this process can use transport `name` (checked once)."""
    try:
        return _registry.transport_class(name).unavailable_reason() is None
    except Exception:
        return False


@functools.cache
def _cuda_ipc_here() -> bool:
    """Say whether this process can export CUDA tensors over cuda_ipc (checked once)."""
    try:
        return _registry.transport_class("cuda_ipc").exports_here()  # type: ignore[attr-defined, no-any-return]
    except Exception:
        return False


def produce(value: Any, transport: str, *, owner: Process | None = None) -> RDTObject:
    """Keep the tensors of `value` here and return the RDTObject describing it.

    Runs on: producer. Blocking (copies into shared memory): call `produce_async` on a loop.
    """
    skeleton, tensors = _tree.flatten(value)
    with store.holding(tensors) as making:  # wait_tensor_freed waits from now on
        _cuda.settle(tensors)  # transports read outside this thread's streams: let them finish
        plan = _plan(transport, tensors)
        return _finish(skeleton, tensors, transport, plan, owner, making)


async def produce_async(value: Any, transport: str, *, owner: Process | None = None) -> RDTObject:
    """`produce`, with large exports, and a transport's first use, done off the running loop."""
    skeleton, tensors = _tree.flatten(value)
    with store.holding(tensors) as making:  # before the first await: wait_tensor_freed waits from now on
        await _cuda.wait(_cuda.record(tensors))  # as in `produce`, with the loop free meanwhile
        plan = _plan(transport, tensors)
        for t in plan:
            if (os.getpid(), t.name) not in _warm:  # e.g. NIXL's agent: ~0.45 s, once
                await _io.to_thread(t.warm_up)
                _warm.add((os.getpid(), t.name))
        limit = min((t.inline_prepare_bytes for t in plan), default=Transport.inline_prepare_bytes)
        if sum(t.numel() * t.element_size() for t in tensors) > limit:
            return await _io.to_thread(_finish, skeleton, tensors, transport, plan, owner, making)
        return _finish(skeleton, tensors, transport, plan, owner, making)


@contextlib.contextmanager
def holding(value: Any) -> Iterator[None]:
    """Hold the tensors of `value` for the block, as a producing call does (see `Store.holding`)."""
    with store.holding(_tree.flatten(value)[1]):
        yield


_warm: set[tuple[int, str]] = set()  # (pid, transport) whose warm_up ran


def _plan(transport: str, tensors: list[torch.Tensor]) -> list[Transport[Any]]:
    if not tensors:
        return []
    return _prepared_transports(transport, tensors)


def _finish(
    skeleton: Any,
    tensors: list[torch.Tensor],
    transport: str,
    plan: list[Transport[Any]],
    owner: Process | None,
    making: int | None = None,
) -> RDTObject:
    """Prepare the planned transports and record the object (`making`: its hold in the store)."""
    owner = owner or here()
    specs = tuple(TensorSpec.of(t) for t in tensors)
    if not tensors:
        return RDTObject(secrets.token_hex(12), owner, transport, specs, skeleton, {}, {}, None)
    obj_id = secrets.token_hex(12)
    if plan and all(t.name == "inline" for t in plan):
        # The bytes ride in the ref, a snapshot: nothing to keep here, no anchor to make.
        meta = {"inline": plan[0].prepare(obj_id, tensors)}
        _recent.add(obj_id, tensors)
        groups = _memberships()
        if groups:
            meta["groups"] = groups
        return RDTObject(obj_id, owner, transport, specs, skeleton, meta, {}, None)
    if making is not None and any(t.name == "shm" for t in plan):
        from .transports import shm

        # Storages returned again and again (a trainer's weights) go to shared memory
        # once; every later export shares them without a copy (see transports/shm.py).
        shm.share_storages(tensors, lambda t: store.can_move(t, making))
    prepared: dict[Transport[Any], Any] = {}
    try:
        for t in plan:
            prepared[t] = t.prepare(obj_id, tensors)
        eager = _eager_replies(tensors, transport, owner, plan)
    except BaseException:
        for t, meta in prepared.items():
            t.garbage_collect(obj_id, meta)
        raise
    store.add(obj_id, StoredObject(list(tensors), prepared))
    anchor = _anchors.take(obj_id)
    meta = {t.name: m for t, m in prepared.items()}
    groups = _memberships()
    if groups:
        meta["groups"] = groups
    return RDTObject(obj_id, owner, transport, specs, skeleton, meta, eager, anchor)


def _eager_replies(
    tensors: list[torch.Tensor], transport: str, owner: Process, plan: list[Transport[Any]]
) -> dict[str, Any]:
    """For producers with no `rdt` group (the driver), put the object-store reply now.

    Only where a consumer may need it: explicit object_store, or auto on a cluster of
    several nodes when nothing prepared reaches other nodes (inline, nixl do).
    """
    if owner.actor is not None or transport not in ("object_store", _registry.AUTO):
        return {}
    if transport == _registry.AUTO and (
        any(t.name in ("inline", "nixl") for t in plan) or not _several_nodes()
    ):
        return {}
    from .transports.object_store import to_wire

    return {"object_store": ray.put(to_wire(tensors))}


_nodes_seen: tuple[float, bool] = (0.0, False)


def _several_nodes() -> bool:
    """Say whether the cluster has more than one alive node (asked of the GCS every 5 s)."""
    global _nodes_seen
    checked, several = _nodes_seen
    if time.monotonic() - checked > 5.0:
        several = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        _nodes_seen = (time.monotonic(), several)
    return several


async def serve_send(obj_id: str, transport: str, request: Any) -> Any:
    """Run the producer's side of a two-sided transfer, asked for by a consumer.

    Runs on: producer (the `rdt` concurrency group, then the I/O loop).
    Raises: ObjectFreedError if the object is gone.
    """
    t = _registry.get(transport)
    with store.reading(obj_id) as stored:  # a free meanwhile: wait_tensor_freed waits for the send
        if stored is None:
            await t.refuse(obj_id, request)
            raise ObjectFreedError(f"object {obj_id} was freed before it was fetched", obj_id=obj_id)
        meta = next((m for tr, m in stored.prepared.items() if tr.name == transport), None)
        stored.served = True
        if stored.fetched_here and not stored.warned:
            stored.warned = True
            log.warning("rdt_async: %s", shared_with_producer(obj_id))
        return await t.send_multiple_tensors(obj_id, stored.tensors, meta, request)


def shared_with_producer(obj_id: str) -> str:
    return (
        f"RDT object {obj_id} was fetched both by the process that produced it, which gets "
        "the stored tensors themselves, and by another process: writing to them in the "
        "producer changes what later fetches elsewhere receive. Clone before writing."
    )


def serve_free(obj_id: str) -> None:
    """Free an object on request of another process. Runs on: producer."""
    store.free(obj_id)


def resolve_local(obj: RDTObject) -> list[torch.Tensor]:
    """Return the tensors themselves of an object this process produced.

    Raises: ObjectFreedError.
    """
    stored = store.get(obj.obj_id)
    if stored is not None:
        return stored.tensors
    tensors = _recent.get(obj.obj_id) if obj.anchor is None else None
    if tensors is None:
        raise ObjectFreedError(f"object {obj.obj_id} was freed", obj_id=obj.obj_id)
    return tensors


def is_local(obj: RDTObject) -> bool:
    """Whether this process produced `obj` and has its tensors (inline ones: while they live)."""
    if obj.producer.token != _token_for(os.getpid()):
        return False
    return obj.anchor is not None or _recent.get(obj.obj_id) is not None


def forget(obj: RDTObject) -> None:
    """`rdt.free` of an object nothing keeps (inline): this process's fetches say freed."""
    _recent.drop(obj.obj_id)
    store.mark_freed(obj.obj_id)


class _Recent:
    """Inline objects made in this process, weakly: its own fetches get its tensors.

    The last LIMIT objects only: a kept tensor returned a million times must not grow
    this. Past that, or once its tensors died, a fetch here decodes the ref's bytes:
    the snapshot every other process sees.
    """

    LIMIT = 4096

    def __init__(self) -> None:
        self._refs: collections.OrderedDict[str, tuple[weakref.ref[torch.Tensor], ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> None:
        refs = tuple(weakref.ref(t) for t in tensors)
        with self._lock:
            self._refs[obj_id] = refs
            if len(self._refs) > self.LIMIT:
                self._refs.popitem(last=False)

    def get(self, obj_id: str) -> list[torch.Tensor] | None:
        with self._lock:
            refs = self._refs.get(obj_id)
        tensors = [r() for r in refs] if refs is not None else None
        return None if tensors is None or any(t is None for t in tensors) else tensors  # type: ignore[misc]

    def drop(self, obj_id: str) -> None:
        with self._lock:
            self._refs.pop(obj_id, None)


_recent = _Recent()


def unavailable(name: str, why: str) -> TransportUnavailableError:
    return TransportUnavailableError(f"transport {name!r} cannot serve this fetch: {why}")


async def await_ref(ref: Any) -> Any:
    """Await a Ray ObjectRef from any loop."""
    return await asyncio.wrap_future(ref.future())


PING_S = 5.0  # how long a failed fetch waits for a producer that answers at once
# How long it then waits for Ray's verdict on a producer that does not answer (its host
# cut off): Ray declares a node dead after its health checks fail, ~10-60 s by its settings.
VERDICT_S = float(os.environ.get("RDT_PEER_VERDICT_S", "90"))


def died_on_this_node(p: Process) -> bool:
    """Say whether the producer ran on this node and its process is gone (at once, no Ray)."""
    return p.node_id == node_id() and not pid_alive(int(p.token.split(":")[0]))


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
    actor = p.actor
    if actor is None or not hasattr(actor, "rdt__ping"):
        return False
    # A live producer answers within `timeout`; a cut-off one is declared dead by Ray
    # within VERDICT_S (its pings fail with ActorUnavailableError meanwhile).
    verdict_by = time.monotonic() + timeout + VERDICT_S
    while (left := verdict_by - time.monotonic()) > 0:
        alive = await _ping(actor, left)
        if alive is not None:
            return not alive
        await asyncio.sleep(min(0.5, max(0.0, verdict_by - time.monotonic())))  # unreachable for now: ask again
    return False


async def _ping(actor: Any, timeout: float) -> bool | None:
    """Ping a producer's `rdt` group: True if it answered, False if Ray says it is dead, None
    if neither within `timeout` or it is unreachable for now (ActorUnavailableError)."""
    ping = asyncio.ensure_future(await_ref(actor.rdt__ping.remote()))
    try:
        await asyncio.wait({ping}, timeout=timeout)
        if not ping.done():
            return None
        ping.result()
        return True
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

    Runs on: consumer, beside a transfer that has run WATCH_AFTER_S (`_api._watched`): a
    ping a second to its `rdt` group, which Ray fails with ActorDiedError once the actor
    (or its host) is declared dead; an unreachable host's pings fail with
    ActorUnavailableError until then.
    """
    while not died_on_this_node(p) and await _ping(p.actor, 10 * WATCH_EVERY_S) is not False:
        await asyncio.sleep(WATCH_EVERY_S)


class RayChannel:
    """The consumer's line to a producer: an actor call to its `rdt` concurrency group."""

    def __init__(self, obj: RDTObject, transport: str) -> None:
        self._obj, self._transport = obj, transport

    async def request_send(self, request: Any) -> Any:
        obj = self._obj
        with translating(f"{self._transport} fetch of {obj.obj_id}", obj.obj_id):
            eager = obj.eager.get(self._transport)
            if eager is not None:
                return await await_ref(eager)
            if obj.producer.actor is None:
                raise unavailable(
                    self._transport,
                    f"the object was put by {obj.producer.label}, which serves no transfers; "
                    "put it with tensor_transport='object_store' or fetch it on its node",
                )
            # A cancelled fetch leaves the producer's send to finish and its reply unread:
            # `ray.cancel` of an actor call still queued in this process leaves a hole in
            # the actor's sequence numbers, and an in-order (sync) producer then waits 30 s
            # for it and fails every call queued meanwhile (seen on Ray 2.60 in our tests).
            ref = obj.producer.actor.rdt__send.remote(obj.obj_id, self._transport, request)
            return await await_ref(ref)


def choose_transport(obj: RDTObject, node_id: str) -> tuple[str, Any]:
    """Pick the transport for a fetch of `obj` by a process on `node_id`.

    `auto`: small CPU objects -> inline (the bytes came with the ref); otherwise the
    candidate both ends can use (shm and cuda_ipc on one node, nixl where prepared and
    loadable here, a group both ends are in, the object store) that the cost model of
    transports/_auto.py expects to finish first; the choice and its reasons are kept
    in `rdt.store_stats()["auto"]`. A one-sided transport that cannot reach this node
    falls back to object_store. Gloo/NCCL objects go over a group both ends share,
    else object_store.
    Returns the transport's name and the metadata its fetch needs.
    """
    name = obj.transport
    shared = _shared_group(obj)
    if name == _registry.AUTO:
        prepared = frozenset(obj.meta) - {"groups"}
        facts = _auto.Facts(
            nbytes=obj.nbytes,
            gpu=any(not s.device.startswith("cpu") for s in obj.specs),
            same_node=obj.producer.node_id == node_id,
            prepared=prepared,
            loads_here=prepared & {"nixl", "cuda_ipc"},  # checked only if one wins: a check may import
            group=shared[0] if shared is not None else None,
        )
        choice = _auto.choose_checked(facts, _loads_here)
        store.record_choice(obj.obj_id, choice)
        name = choice.transport
    if name == "shm" and obj.producer.node_id != node_id:
        name = "object_store"
    if name in ("gloo", "nccl"):
        if shared is None or shared[0] != name:
            _raise_if_broken(obj)  # a group we share is broken: say so, do not fall back
            return "object_store", None  # the consumer is outside the producer's groups
        return name, shared[1]
    return name, obj.meta.get(name)


def _shared_group(obj: RDTObject) -> tuple[str, Any] | None:
    """Return (backend, GlooMeta) of a usable group both ends are in, or None."""
    theirs = obj.meta.get("groups")
    gloo = sys.modules.get("rdt_async.transports.gloo")
    if not theirs or gloo is None:
        return None
    ours = gloo.groups.memberships()
    devices = {s.device.split(":")[0] for s in obj.specs}
    for name, (backend, rank) in theirs.items():
        if name in ours and ours[name][0] == backend and devices <= {"cpu" if backend == "gloo" else "cuda"}:
            return backend, gloo.GlooMeta(name, rank)
    return None


def _raise_if_broken(obj: RDTObject) -> None:
    gloo = sys.modules.get("rdt_async.transports.gloo")
    theirs = obj.meta.get("groups") or {}
    for group in gloo.groups.broken() if gloo is not None else ():
        if group.name in theirs:
            group.check()


def _memberships() -> dict[str, tuple[str, int]]:
    gloo = sys.modules.get("rdt_async.transports.gloo")
    return gloo.groups.memberships() if gloo is not None else {}


def is_ref(x: Any) -> bool:
    return isinstance(x, ray.ObjectRef)


@functools.lru_cache(maxsize=1)
def node_id() -> str:
    """This process's node (cached; a new session clears it)."""
    return ray.get_runtime_context().get_node_id()


def get_ref(ref: Any, timeout: float | None) -> Any:
    return ray.get(ref, timeout=timeout)


def free_remote(obj: RDTObject) -> None:
    """Ask the producer to free `obj` now (fire and forget)."""
    if obj.producer.actor is None:
        raise RDTError(
            f"object {obj.obj_id} was put by {obj.producer.label}: call rdt.free() there",
            obj_id=obj.obj_id,
        )
    obj.producer.actor.rdt__free.remote(obj.obj_id)


def put_object(obj: RDTObject) -> Any:
    """Return an ObjectRef to `obj` (ours to own; it carries the anchor)."""
    return ray.put(obj)


# Transports registered in one process reach every other one through Ray's GCS key-value
# store: `rdt.register_transport` publishes (name, devices, class) there, now or at the
# next `ray.init()`, and a lookup miss in any process reads it back (the registry's
# cluster hooks). Classes from user code (a script, a test module) travel by value.
_KV_NAMESPACE = "rdt_async"
_published: dict[str, bytes] = {}


def _kv_key(name: str) -> bytes:
    return f"transport:{name}".encode()


def _kv_ready() -> bool:
    from ray.experimental import internal_kv

    return ray.is_initialized() and internal_kv._internal_kv_initialized()


def _publish_transport(reg: _registry.Registration) -> None:
    """Publish a registration for the cluster. Raises: TypeError if it cannot be pickled."""
    _published[reg.name] = _pickle_transport(reg)
    hooks = ray._private.worker._post_init_hooks
    if _publish_all not in hooks:
        hooks.append(_publish_all)
    if _kv_ready():
        _publish_all()


def _publish_all() -> None:
    from ray.experimental import internal_kv

    for name, blob in list(_published.items()):
        internal_kv._internal_kv_put(_kv_key(name), blob, overwrite=True, namespace=_KV_NAMESPACE)


def _pickle_transport(reg: _registry.Registration) -> bytes:
    import sys

    from ray import cloudpickle

    module = sys.modules.get(reg.cls.__module__)
    if module is not None and _is_user_code(module) and not cloudpickle.cloudpickle._is_registered_pickle_by_value(module):
        # For good: the metadata its objects carry comes from the same module.
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((reg.name, reg.devices, reg.cls))
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
    ours = os.path.dirname(os.path.realpath(__file__)) + os.sep
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


_registry.set_cluster_hooks(resolve=_resolve_transport, publish=_publish_transport)
