"""RDTObject, where it lives, and the anchor lifetime.

Lifetime: every object with tensors carries an *anchor*, a tiny object this process
owns (a return of its own `rdt__anchors` method in an `rdt.remote` actor, else a
`ray.put`), with Ray's out-of-scope callback registered on it. The RDTObject holds the
anchor's ref, so Ray's distributed reference counting keeps the anchor alive while
any ref to the RDTObject, or any deserialized copy of it, exists anywhere. When the
last one goes, the callback frees the tensors here. The producer never keeps the
anchor itself.

Making objects is `_produce.py`'s job, fetching them `_fetch.py`'s; every other call
into Ray is in `_ray.py`.
"""

from __future__ import annotations

import atexit
import collections
import functools
import operator
import os
import pickle
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

import msgpack
import ray
import torch

from . import _io, _ray
from ._errors import NotFetchedError, ObjectFreedError, TransferError
from ._store import log, store
from ._tree import Slot
from .transports._base import TensorSpec, check_specs

if not hasattr(ray._raylet.CoreWorker, "add_object_out_of_scope_callback"):  # type: ignore[attr-defined]
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
    Rebuilding one makes Ray load the actor's class from the GCS (~100 ms the first time
    in a process), so code on an event loop awaits `handle()`, which does it off the loop.
    """

    node_id: str
    token: str
    actor_id: str | None = None
    actor_state: bytes | None = field(default=None, compare=False, repr=False)
    serves: bool = field(default=False, compare=False)  # an `rdt.remote` actor: its `rdt` group answers

    @property
    def actor(self) -> Any:
        """The producer's ActorHandle (a ClientActorHandle in a Ray Client driver), or None for
        the driver and tasks (blocks to rebuild it)."""
        if self.actor_state is None:
            return None
        handle = _handles.get((self.token, self.actor_id))
        if handle is None:
            handle = _ray.actor_handle(self.actor_state)
            if _ray.actor_id_of(handle) != self.actor_id:
                named = "no actor" if self.actor_id is None else f"actor {str(self.actor_id)[:16]}"
                raise TransferError(  # (a ref's fields are input: its handle must be the actor it names)
                    f"the ref's producer handle is not one of {named}, which the ref names as its producer; "
                    "pass refs as rdt_async hands them out"
                )
            _handles[self.token, self.actor_id] = handle
        return handle

    async def handle(self) -> Any:
        """`actor`, rebuilt in the pool the first time: the caller's loop stays free."""
        if self.actor_state is None or (self.token, self.actor_id) in _handles:
            return self.actor
        return await _io.to_thread(lambda: self.actor, purpose=_io.CALLS)

    def call_soon(self, fn: Callable[[Any], Any]) -> None:
        """Call `fn(actor)` now if the handle is here, else once the pool has rebuilt it."""
        if (self.token, self.actor_id) in _handles:
            fn(self.actor)
            return

        def rebuilt() -> None:
            try:
                fn(self.actor)
            except Exception:
                log.exception("rdt: a call to %s failed", self.label)

        _io.pool(_io.CALLS).submit(rebuilt)

    @property
    def pid(self) -> int:
        """The producer's process id on its node, from its token (`<pid>:<hex>`).

        Raises: TransferError if the token is not one `here()` makes (it came from another process).
        """
        m = _TOKEN.fullmatch(self.token) if type(self.token) is str else None
        if m is None or int(m[1]) > PID_MAX:
            raise TransferError(f"the ref's producer token {self.token!r} is not one a producer makes (<pid>:<hex>)")
        return int(m[1])

    @property
    def label(self) -> str:
        if self.actor_id is None:
            return f"driver/process {self.token.split(':')[0]}"
        return f"actor {self.actor_id[:8]}"


# (process token, actor id) -> ActorHandle rebuilt in this process: by both, so that a ref
# naming an honest producer's token with another actor's handle sends no later ref of it there.
_handles: dict[tuple[str, str | None], Any] = {}
_TOKEN = re.compile(r"([1-9][0-9]{0,6}):[0-9a-z]{1,32}")
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: a larger "pid" is no process (and overflows os.kill)


def check(obj: RDTObject) -> None:
    """Refuse an RDTObject whose fields no producer makes: everything in it came from
    another process (its specs size buffers and reads, its token names a process).

    Runs on: consumer, before a fetch uses it.
    Raises: TransferError naming the field.
    """
    if type(obj.obj_id) is not str or not _OBJ_ID.fullmatch(obj.obj_id):
        raise TransferError(f"the ref's object id {obj.obj_id!r} is not one a producer makes")
    check_specs(obj.specs, obj.obj_id)
    meta = obj.meta
    if type(meta) is not dict or not all(type(k) is str for k in meta):
        raise TransferError(f"the ref's transport metadata is a {type(meta).__name__}, not a dict by transport name")
    groups = meta.get("groups")
    if groups is not None and (
        type(groups) is not dict
        or not all(type(k) is str and type(v) is tuple and len(v) == 2 and type(v[0]) is str for k, v in groups.items())
    ):
        raise TransferError(f"the ref's collective groups {groups!r:.120} are not {{name: (backend, rank)}}")
    p = obj.producer
    p.pid  # noqa: B018  (checks the token)
    if type(p.node_id) is not str or not _NODE_ID.fullmatch(p.node_id):
        raise TransferError(  # (it keys what `auto` remembers of a node, and is logged)
            f"the ref's producer node id {p.node_id!r:.80} is not one a producer makes (a Ray node id: "
            f"{_NODE_HEX} hex digits): the ref was altered; pass refs as rdt_async hands them out"
        )
    if p.serves and (type(p.actor_id) is not str or type(p.actor_state) is not bytes):
        raise TransferError(  # (its `rdt` group is asked through that handle: a fetch's checks, frees)
            f"the ref says its producer is an rdt actor, but names no actor id and handle for it "
            f"({p.actor_id!r}, {type(p.actor_state).__name__}); pass refs as rdt_async hands them out"
        )


_OBJ_ID = re.compile(r"[0-9a-f]{24}")
_NODE_HEX = 56  # a Ray NodeID's 28 bytes, as `get_node_id()` spells them
_NODE_ID = re.compile(rf"[0-9a-f]{{{_NODE_HEX}}}")


@functools.lru_cache(maxsize=1)
def _token_for(pid: int) -> str:
    return f"{pid}:{secrets.token_hex(6)}"


def here() -> Process:
    """Return this process's identity (Ray must be initialized; asked of Ray once per
    process, session and actor: a producer's every return names it, and a worker that
    ran tasks may become an actor). An actor's process stays that actor: its identity
    is had without asking Ray which actor runs here (~40 us on a core that idled)."""
    global _actor_here
    mine = _actor_here
    if mine is not None and mine[0] == os.getpid():
        return mine[1]
    me = _here(os.getpid(), ray._private.worker.global_worker.actor_id, _ray.in_client())
    if me.actor_id is not None:
        _actor_here = (os.getpid(), me)
    return me


_actor_here: tuple[int, Process] | None = None  # (pid, identity) of the actor this process is


@functools.lru_cache(maxsize=1)
def _here(pid: int, actor: Any, client: bool) -> Process:
    if client:  # a Ray Client driver: no node (`_ray.NO_NODE`), no actor
        return Process(_ray.NO_NODE, _token_for(pid))
    ctx = ray.get_runtime_context()
    if ctx.worker.mode == ray.WORKER_MODE and ctx.get_actor_id() is not None:
        actor_id, state, serves = _current_actor()
        return Process(ctx.get_node_id(), _token_for(os.getpid()), actor_id, state, serves)
    return Process(ctx.get_node_id(), _token_for(os.getpid()))


@functools.lru_cache(maxsize=1)
def _current_actor() -> tuple[str, bytes, bool]:
    """This actor's id, its handle pickled out of band, and whether it serves `rdt__*` calls
    (made once per process)."""
    handle = ray.get_runtime_context().current_actor
    return handle._ray_actor_id.hex(), pickle.dumps(handle), hasattr(handle, "rdt__ping")


_NBYTES = operator.attrgetter("nbytes")  # (a spec's: summed without a generator, on every fetch)


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
        return sum(map(_NBYTES, self.specs))

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """As Ray carries it to each consumer: the fields a producer makes in one msgpack
        record (`_wire`), the skeleton, the transports' metadata and the anchor beside it
        for Ray's pickler, which tracks the anchor's ref. Ray's pickler calls back into
        Python for every object it meets; the record spares it the producer's identity, the
        specs and their dtypes: ~0.1 ms a pass at 4 KiB. An object not as a producer makes
        it (crafted) pickles field by field, as a dataclass, for the consumer's checks."""
        wire = _wire(self)
        if wire is None:
            return super().__reduce_ex__(protocol)
        record, beside = wire  # beside: the skeleton, or what of it the record does not hold
        return _rebuilt, (record, beside, self.meta, self.eager, self.anchor)

    def __repr__(self) -> str:
        shown = ", ".join(str(s) for s in self.specs[:4]) + (", ..." if len(self.specs) > 4 else "")
        return (
            f"RDTObject({self.obj_id[:12]}, {len(self.specs)} tensor(s) [{shown}], "
            f"{self.nbytes} bytes, transport={self.transport}, held by {self.producer.label}; "
            "get the value with `await rdt.fetch(obj)` or `rdt.get(obj)`)"
        )

    # Used as its value (a plain `@ray.remote` consumer handed it, a `ray.get` of its ref):
    # say what it is and how to get the value, at the line that made the mistake.

    def _not_the_value(self, what: str) -> NotFetchedError:
        return NotFetchedError(
            f"{what} of an RDTObject: it is a reference to {len(self.specs)} tensor(s) held by "
            f"{self.producer.label}, not the value. Get the value with `await rdt.fetch(obj)` "
            "(`rdt.get(obj)` in sync code), or make the receiving actor an `@rdt.remote` actor: "
            "its methods receive top-level RDT arguments already fetched"
        )

    def __getitem__(self, key: Any) -> Any:
        raise self._not_the_value(f"[{key!r}]")

    def __iter__(self) -> Any:
        raise self._not_the_value("iteration")

    def __len__(self) -> int:
        raise self._not_the_value("len()")

    def __bool__(self) -> bool:
        return True  # (not `len()`: an object is there)

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise. Private names, and fields not set yet (an
        # object being unpickled), are a plain AttributeError: pickle, copy and hasattr
        # probe them.
        if name.startswith("_") or name in RDTObject.__dataclass_fields__ or hasattr(RDTObject, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise self._not_the_value(f".{name}")


_WIRE_VERSION = 4


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by the name a wire record gives them (`float32`)."""
    return {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    """The name a wire record gives each of torch's dtypes (`_dtypes`, the other way)."""
    return {d: name for name, d in _dtypes().items()}


def _producer_typed(fields: tuple[Any, ...]) -> bool:
    """Whether a producer's fields, in a wire record's order (node id, token, actor id, its
    handle's state, whether it serves), are of the types a producer makes: `_wire` writes
    only these, `_rebuilt` reads only these. (Spelled out, not a table walked by a
    generator: it runs on every ref's way out and in.)"""
    node_id, token, actor_id, actor_state, serves = fields
    return (
        type(node_id) is str and type(token) is str and type(serves) is bool
        and (actor_id is None or type(actor_id) is str) and (actor_state is None or type(actor_state) is bytes)
    )


def _wire(obj: RDTObject) -> tuple[bytes, Any] | None:
    """`obj`'s id, producer, transport and specs as one msgpack record, and what travels
    beside it: the skeleton, or where the record holds its names (`_slot_keys`), its
    `_metadata` or None. None where a field is not of the type a producer makes it."""
    p, names = obj.producer, _dtype_names()
    if type(p) is not Process or type(obj.specs) is not tuple or type(obj.obj_id) is not str or type(obj.transport) is not str:
        return None
    producer = (p.node_id, p.token, p.actor_id, p.actor_state, p.serves)
    if not _producer_typed(producer):
        return None
    specs = []
    for s in obj.specs:
        if type(s) is not TensorSpec or type(s.shape) is not tuple or not all(type(n) is int for n in s.shape):
            return None
        name = names.get(s.dtype) if isinstance(s.dtype, torch.dtype) else None
        if name is None:
            return None
        specs.append((s.shape, name, s.device, s.nbytes))
    slots = _slot_keys(obj.skeleton, len(specs))
    keys, kind, beside = (None, None, obj.skeleton) if slots is None else slots
    fields = (_WIRE_VERSION, obj.obj_id, *producer, obj.transport, specs, keys, kind)
    try:
        return msgpack.packb(fields, use_bin_type=True), beside
    except (TypeError, ValueError, OverflowError):  # a field of another type: as a dataclass
        return None


# The kinds of skeleton a wire record holds as names: a dict; an OrderedDict; an
# OrderedDict with `_metadata` (`model.state_dict()`'s, its modules' versions: beside);
# a lone tensor (no names: the value is its one tensor).
_DICT, _ORDERED, _STATE_DICT, _TENSOR = 0, 1, 2, 3


def _slot_keys(skeleton: Any, n: int) -> tuple[tuple[str, ...], int, Any] | None:
    """The keys, kind and `_metadata` of a skeleton that is a dict of `n` tensors by
    name, in order (a state dict, `model.state_dict()`'s OrderedDict, a published
    version), or a lone tensor; else None. Such a skeleton travels as its keys in the
    wire record: pickled, each of its slots was another call into Python."""
    t = type(skeleton)
    if t is Slot:
        return ((), _TENSOR, None) if n == 1 and skeleton.index == 0 else None
    if (t is not dict and t is not collections.OrderedDict) or len(skeleton) != n:
        return None
    attrs = vars(skeleton) if t is collections.OrderedDict else {}
    if attrs.keys() - {"_metadata"}:
        return None
    for i, (k, v) in enumerate(skeleton.items()):
        if type(k) is not str or type(v) is not Slot or v.index != i:
            return None
    if t is dict:
        return tuple(skeleton), _DICT, None
    return (tuple(skeleton), _STATE_DICT, attrs["_metadata"]) if attrs else (tuple(skeleton), _ORDERED, None)


def _skeleton_of(keys: Any, kind: Any, beside: Any, n: int) -> Any:
    """The skeleton a wire record's names, kind and what came beside them make (`_slot_keys`).

    Raises: ValueError where they are not what a producer writes."""
    if kind == _TENSOR and type(kind) is int:
        if keys != () or n != 1 or beside is not None:
            raise ValueError("a lone tensor's skeleton with names, beside it, or for other than one tensor")
        return Slot(0)
    if type(keys) is not tuple or not all(type(k) is str for k in keys):
        raise ValueError("a skeleton's keys that are not names")
    if len(set(keys)) != len(keys) or len(keys) != n:
        raise ValueError("a skeleton's keys that are not one name per tensor")
    if kind not in (_DICT, _ORDERED, _STATE_DICT) or type(kind) is not int:
        raise ValueError("a skeleton's kind that no producer writes")
    if kind != _STATE_DICT and beside is not None:
        raise ValueError("a skeleton's keys and a skeleton beside them")
    if kind == _DICT:
        return {k: Slot(i) for i, k in enumerate(keys)}
    skeleton = collections.OrderedDict((k, Slot(i)) for i, k in enumerate(keys))
    if kind == _STATE_DICT:
        skeleton._metadata = beside  # type: ignore[attr-defined]
    return skeleton


def _rebuilt(wire: bytes, skeleton: Any, meta: Any, eager: Any, anchor: Any) -> RDTObject:
    """The RDTObject of a wire record (`RDTObject.__reduce_ex__`), as Ray unpickles it.

    Raises: TransferError where the record is not one `_wire` makes (what its fields hold
    is checked by `check` before a fetch uses them, as for every ref).
    """
    try:
        fields = msgpack.unpackb(wire, use_list=False, raw=False)
        version, obj_id, node_id, token, actor_id, actor_state, serves, transport, specs, keys, kind = fields
        producer = (node_id, token, actor_id, actor_state, serves)
        if version != _WIRE_VERSION or type(obj_id) is not str or type(transport) is not str or type(specs) is not tuple:
            raise ValueError("a field of the wrong type")
        if not _producer_typed(producer):
            raise ValueError("a producer field of the wrong type")
        if keys is not None:
            skeleton = _skeleton_of(keys, kind, skeleton, len(specs))
        elif kind is not None:
            raise ValueError("a skeleton's kind without its names")
        names = _dtypes()
        tensor_specs = tuple(TensorSpec(tuple(shape), names.get(dtype, dtype), device, nbytes) for shape, dtype, device, nbytes in specs)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise TransferError(
            f"an RDTObject arrived in a form no producer makes ({type(exc).__name__}: {exc}); "
            "pass refs as rdt_async hands them out, unaltered"
        ) from None
    return RDTObject(obj_id, Process(*producer), transport, tensor_specs, skeleton, meta, eager, anchor)


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
            _io.pool(_io.CALLS).submit(self._refill, session)
        cw = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]  # set by ray.init
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
    me = here()
    return me.actor if me.serves else None


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
    store.release_lent()
    global _actor_here
    _anchor_source.cache_clear()
    _here.cache_clear()
    _actor_here = None
    _handles.clear()
    _ray.new_session()


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


def resolve_local(obj: RDTObject) -> list[torch.Tensor]:
    """Return the tensors themselves of an object this process produced, once they are
    what the ref says (the ref came from elsewhere: a copy into `into=` would broadcast
    and convert).

    Raises: ObjectFreedError; TransferError naming the first tensor that differs.
    """
    stored = store.get(obj.obj_id)
    tensors = stored.tensors if stored is not None else _recent.get(obj.obj_id) if obj.anchor is None else None
    if tensors is None:
        raise ObjectFreedError(f"object {obj.obj_id} was freed", obj_id=obj.obj_id)
    if len(tensors) != len(obj.specs):
        raise TransferError(
            f"the ref names object {obj.obj_id}, which this process produced, with {len(obj.specs)} "
            f"tensor(s); it has {len(tensors)}: the ref was altered"
        )
    for k, (t, spec) in enumerate(zip(tensors, obj.specs)):
        if TensorSpec.of(t) != spec:
            raise TransferError(
                f"the ref names object {obj.obj_id}, which this process produced, and says its tensor {k} is "
                f"{spec}; it is {TensorSpec.of(t)}: the ref was altered"
            )
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


def snapshot_only(obj: RDTObject) -> RDTObject:
    """`obj`, whose fetches in this process too decode the bytes in its ref where it is
    inline (not the tensors it was made of, `_recent`): for memory reused once the object
    is made (a publisher's slot: an inline version holds nothing, so the next publish may
    write that slot at once)."""
    if obj.anchor is None:
        _recent.drop(obj.obj_id)
    return obj


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
        if refs is None:
            return None
        tensors = [r() for r in refs]
        alive = [t for t in tensors if t is not None]
        return alive if len(alive) == len(tensors) else None

    def drop(self, obj_id: str) -> None:
        with self._lock:
            self._refs.pop(obj_id, None)


_recent = _Recent()
