"""The producer's side: keep a returned value's tensors, prepare transports, serve sends and frees.

What `auto` prepares an object for is asked of the transports (`_auto.plan`: what each
declares it costs, reaches and takes), never decided by their names. With the built-ins:
a small CPU object rides in the ref (inline); a bigger one is exported to shm for
consumers of this node, and on a cluster of several nodes prepared for tcp as well (a
listener, once, and no copy), and for nixl where the costs say it reads faster (an RDMA
network's, given in RDT_AUTO_COSTS). A GPU object is exported for cuda_ipc where this
process's memory can be, and prepared for nixl for other nodes where NIXL loads. Else
it goes through the object store. The consumer picks (`_choose.py`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from . import _cuda, _io, _ray, _tree
from ._errors import ObjectFreedError, TransportUnavailableError
from ._membership import groups
from ._object import Process, RDTObject, _anchors, _recent, here
from ._store import StoredObject, log, shared_with_producer, store
from .transports import _auto, _registry
from .transports._base import TensorSpec, Transport

_registry.hand_store(store)  # transports that answer requests themselves serve from it


def check_grouped(name: str, what: str) -> None:
    """Refuse a two-sided transport in a process that is in no group of its backend.

    Runs on: producer: before a producing method's body runs (`what` names the method),
    and again where the tensors are kept (a `put`; a group may have gone meanwhile).
    Raises: TransportUnavailableError naming the fix.
    """
    if name == _registry.AUTO:
        return  # (on every call of an `auto` producer: auto takes a group only where one is)
    cls = _registry.known_class(name)
    if cls is not None and cls.needs_group and not any(b == name for b, _ in groups.memberships().values()):
        raise TransportUnavailableError(
            f"{what}: this process is in no {name} group, so no consumer could fetch over {name} (every fetch "
            f"would go through the object store): create one first, rdt.create_collective_group(actors, "
            f"backend={name!r}), or produce with tensor_transport='auto'"
        )


def check_movable(tensors: Sequence[torch.Tensor]) -> None:
    """Refuse a tensor that no transport can move as its bytes, naming the fix (`unmovable`).

    Runs on: producer, when the value is returned (a few attribute reads a tensor).
    Raises: TransportUnavailableError.
    """
    for i, t in enumerate(tensors):
        why = unmovable(t)
        if why is not None:
            raise TransportUnavailableError(f"returned tensor {i} is {why}")


def unmovable(t: torch.Tensor) -> str | None:
    """Why `t` cannot be moved as its bytes, and the fix; None where it can.

    A quantized tensor's meaning is in its scale and zero point, a nested one's in its
    offsets; a meta tensor or a wrapper subclass (DTensor, FakeTensor) has no memory of
    its own. Moved as bytes, each would arrive wrong, be read from address 0 (a crash of
    the producer), or not at all.
    """
    if t.is_quantized:
        return (f"a quantized tensor ({t.dtype}), which would move as its integers without its scale and zero "
                "point: return t.dequantize(), or t.int_repr() and the quantization parameters beside it")
    if t.is_nested:
        return "a nested tensor, not one block of bytes: return its tensors (t.unbind()) or t.to_padded_tensor(0)"
    if t.is_meta:
        return "on the meta device, which holds no bytes to move: return a tensor on a device with memory (cpu, cuda)"
    if type(t) is not torch.Tensor and not has_memory(t):
        return (f"a {type(t).__name__} without memory of its own (a wrapper subclass, as DTensor and FakeTensor "
                "are), so there are no bytes to move: return the tensor it stands for (a DTensor's "
                "t.to_local() or t.full_tensor())")
    return None


def has_memory(t: torch.Tensor) -> bool:
    """Whether `t` has bytes of its own to move (no elements: nothing to read, so yes)."""
    return t.numel() == 0 or _tree.address(t) != 0


def _prepared_transports(name: str, tensors: Sequence[torch.Tensor]) -> list[Transport[Any]]:
    """Transports to prepare at return time for a method asking for `name`."""
    check_movable(tensors)
    if _ray.in_client():
        return _client_plan(name, tensors)
    if name != _registry.AUTO:
        transport = _registry.transport(name)
        transport.check_tensors(tensors)
        check_grouped(name, f"tensor_transport={name!r}")
        return [transport]
    return _prepared_transports_auto(tensors)


def _prepared_transports_auto(tensors: Sequence[torch.Tensor]) -> list[Transport[Any]]:
    """`_prepared_transports` for `auto`: what `_auto.plan` takes for these tensors."""
    try:
        _registry.transport(_registry.FALLBACK).check_tensors(tensors)  # what auto falls back to
    except TransportUnavailableError as exc:  # said as what the user asked for: auto
        raise TransportUnavailableError(f"tensor_transport='auto' cannot move these tensors: {exc}") from exc
    devices = frozenset(t.device.type for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    costs = os.environ.get("RDT_AUTO_COSTS", "")
    names = _auto_plan(devices, nbytes, _ray.several_nodes(), costs, _registry.generation())
    return [_registry.transport(n) for n in names]  # nothing: object_store


def _client_plan(name: str, tensors: Sequence[torch.Tensor]) -> list[Transport[Any]]:
    """What a put in a Ray Client driver prepares: no transport of the cluster's reaches
    that process, so the bytes ride in the ref (`auto`'s choice for a small object, or a
    transport named that carries them), else go to Ray's object store at once (`_finish`).

    Raises: TransportUnavailableError for a transport named that needs the tensors kept here.
    """
    if name == _registry.AUTO:
        plan = _prepared_transports_auto(tensors)
        return plan if plan and all(t.carries_bytes for t in plan) else []
    transport = _registry.transport(name)
    if name != _registry.FALLBACK and not transport.carries_bytes:
        raise TransportUnavailableError(
            f"rdt.put(..., tensor_transport={name!r}) in a Ray Client driver (ray.init('ray://...')): {name} "
            "would serve the tensors from this process, which is not a process of the cluster, so no consumer "
            "could reach it; put with tensor_transport='auto' or 'object_store' (the bytes go to Ray's object "
            "store now), or put inside an actor"
        )
    transport.check_tensors(tensors)
    return [transport]


@functools.lru_cache(maxsize=256)
def _auto_plan(devices: frozenset[str], nbytes: int, several: bool, costs: str, generation: int) -> tuple[str, ...]:
    """`_auto.plan`'s names, remembered per (facts, RDT_AUTO_COSTS, the classes known): a
    producer returning objects like its last ones (a weight sync) pays a lookup."""
    return tuple(c.name for c in _auto.plan(_registry.known_classes(), devices, nbytes, several, exports_here))


@functools.cache
def exports_here(cls: type[Transport[Any]]) -> bool:
    """Whether this process can prepare objects for transport `cls` (checked once: it may
    import a library)."""
    try:
        return cls.exports_here()
    except Exception:
        return False


@functools.cache
def loads_here(name: str) -> bool:
    """Say whether this process can use transport `name` (checked once)."""
    try:
        return _registry.transport_class(name).unavailable_reason() is None
    except Exception:
        return False


def produce(value: Any, transport: str, *, owner: Process | None = None) -> RDTObject:
    """Keep the tensors of `value` here and return the RDTObject describing it.

    Runs on: producer. Blocking (copies into shared memory): call `produce_async` on a loop.
    """
    skeleton, tensors = _flatten(value)
    with store.holding(tensors):  # wait_tensor_freed waits from now on
        _cuda.settle(tensors)  # transports read outside this thread's streams: let them finish
        plan = _plan(transport, tensors)
        return _finish(skeleton, tensors, transport, plan, owner)


async def produce_async(value: Any, transport: str, *, owner: Process | None = None) -> RDTObject:
    """`produce`, with large exports, and a transport's first use, done off the running loop."""
    skeleton, tensors = _flatten(value)
    with store.holding(tensors):  # before the first await: wait_tensor_freed waits from now on
        await _cuda.wait(_cuda.record(tensors))  # as in `produce`, with the loop free meanwhile
        if transport == _registry.AUTO and not _registry.builtins_loaded():  # (~60 ms of imports, once)
            await _io.to_thread(_registry.known_classes, purpose=_io.CALLS)
        plan = _plan(transport, tensors)
        cold = [t.name for t in plan if (os.getpid(), t.name) not in _warm]
        if cold:  # e.g. NIXL's agent: ~0.45 s, once
            await _io.to_thread(warm_up, cold, purpose=_io.CALLS)
        limit = min((t.inline_prepare_bytes for t in plan), default=Transport.inline_prepare_bytes)
        if sum(t.numel() * t.element_size() for t in tensors) > limit:
            return await _io.to_thread(_finish, skeleton, tensors, transport, plan, owner)
        return _finish(skeleton, tensors, transport, plan, owner)


def _flatten(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """`_tree.flatten` (tied tensors once), with lazy conjugate and negative views resolved (a copy each).

    Their bits live in the tensor, not its bytes: every transport moves bytes, so such a
    view would arrive unconjugated (shm, gloo) or not at all (inline, tcp, object_store).
    """
    skeleton, tensors = _tree.flatten(value, tied=True)  # a tensor under two names is moved once
    if any(t.is_conj() or t.is_neg() for t in tensors):
        tensors = [t.resolve_conj().resolve_neg() for t in tensors]
    return skeleton, tensors


def warm_up(names: Iterable[str], named: Iterable[str] | None = None) -> None:
    """Load now what producing over (or fetching with) the transports `names` would load
    on first use.

    Runs on: either side (blocking): at an actor's creation, before its loop serves
    anything (see `at_creation`); and in the pool at a transport's first use otherwise.
    Loading NIXL holds the GIL for ~0.05 s (up to ~0.3 s from a cold page cache)
    whatever thread does it, and creating its agent takes ~0.5 s, so a first object
    made or fetched later would wait that long (UCXX opens its UCX without the GIL,
    `transports/ucxx._open_ucx`). `auto` stands for nothing here: `at_creation` says
    when it means nixl. `named`: the transports the caller named itself (all where None);
    one loaded only because `auto` may take it that is unavailable here
    (TransportUnavailableError: a setting of its, say) is logged and left to `auto`,
    which takes another path.
    """
    _ray.hand_node_ip()  # UCX keeps its network to the interface of this address
    asked = None if named is None else set(named)
    for name in dict.fromkeys(names):
        if name == _registry.AUTO or (os.getpid(), name) in _warm or not loads_here(name):
            continue  # what cannot load here says so where it is used
        try:
            _registry.transport(name).warm_up()
        except TransportUnavailableError as exc:
            if asked is None or name in asked:
                raise
            log.warning("rdt_async: %s, which auto may take, is unavailable here: %s", name, exc)
            continue
        _warm.add((os.getpid(), name))


def at_creation(named: Iterable[str]) -> list[str]:
    """What an `rdt.remote` actor loads at creation: the transports its methods name, and
    those whose `warm_at_creation` says so (NIXL where `auto` may take it)."""
    out = [n for n in named if n != _registry.AUTO]
    classes = _registry.known_classes()
    kinds = ["cpu", "gpu"] if _gpus_here() else ["cpu"]
    for cls in classes:
        when = cls.warm_at_creation()
        if when == "always" or (when == "where auto may take it" and _auto.may_take(cls, classes, kinds, _ray.several_nodes())):
            out.append(cls.name)
    return list(dict.fromkeys(out))


def _gpus_here() -> bool:
    """Whether this process sees a CUDA device (without creating a context)."""
    return bool(torch.cuda.is_available())


@contextlib.contextmanager
def holding(value: Any) -> Iterator[None]:
    """Hold the tensors of `value` for the block, as a producing call does (see `Store.holding`)."""
    with store.holding(_tree.flatten(value)[1]):
        yield


_warm: set[tuple[int, str]] = set()  # (pid, transport) whose warm_up ran


def _plan(transport: str, tensors: list[torch.Tensor]) -> list[Transport[Any]]:
    if not tensors:
        return []
    _ray.hand_node_ip()  # what listeners advertise (a dict lookup after the first)
    return _prepared_transports(transport, tensors)


def _finish(
    skeleton: Any,
    tensors: list[torch.Tensor],
    transport: str,
    plan: list[Transport[Any]],
    owner: Process | None,
) -> RDTObject:
    """Prepare the planned transports and record the object."""
    owner = owner or here()
    specs = tuple(TensorSpec.of(t) for t in tensors)
    obj_id = os.urandom(12).hex()  # (`secrets.token_hex`'s bytes, without its three calls)
    if not tensors:
        return RDTObject(obj_id, owner, transport, specs, skeleton, {}, {}, None)
    if plan and all(t.carries_bytes for t in plan):
        # The bytes ride in the ref, a snapshot: nothing to keep here, no anchor to make.
        meta = {t.name: t.prepare(obj_id, tensors) for t in plan}
        _recent.add(obj_id, tensors)
        shared = groups.memberships()
        if shared:
            meta["groups"] = shared
        return RDTObject(obj_id, owner, transport, specs, skeleton, meta, {}, None)
    prepared: dict[Transport[Any], Any] = {}
    # `auto` on several nodes, from an actor that serves requests: node-local exports (a
    # copy into shared memory) wait for a consumer of this node to ask (most may be on others).
    lazy = transport == _registry.AUTO and owner.serves and any(t.reach == "cluster" for t in plan)
    try:
        for t in plan:
            prepare = t.prepare_lazily if lazy and t.reach == "node" else t.prepare
            if transport == _registry.AUTO:
                try:
                    prepared[t] = prepare(obj_id, tensors)
                except TransportUnavailableError as exc:  # (no room in /dev/shm, no free port): another path
                    _say_skipped(t.name, exc)
            else:
                prepared[t] = prepare(obj_id, tensors)
        eager = _eager_replies(tensors, transport, owner, list(prepared))
    except BaseException:
        for t, meta in prepared.items():
            t.garbage_collect(obj_id, meta)
        raise
    meta = {t.name: m for t, m in prepared.items()}
    if owner.node_id == _ray.NO_NODE:
        # A Ray Client driver's put: nothing stays here, where no consumer could reach it
        # (nor Ray's out-of-scope callbacks, which an anchor needs). Its object-store reply
        # holds the bytes, as long as a ref to the object lives; its own fetches get the
        # tensors, as of an inline object.
        _recent.add(obj_id, tensors)
        return RDTObject(obj_id, owner, transport, specs, skeleton, meta, eager, None)
    store.add(obj_id, StoredObject(list(tensors), prepared))
    try:
        anchor = _anchors.take(obj_id)
    except BaseException:  # (Ray shutting down): nothing would ever free it
        store.free(obj_id)
        raise
    shared = groups.memberships()
    if shared:
        meta["groups"] = shared
    return RDTObject(obj_id, owner, transport, specs, skeleton, meta, eager, anchor)


_skipped: set[tuple[int, str]] = set()  # (pid, transport) whose failed prepare was said


def _say_skipped(name: str, exc: Exception) -> None:
    """Say once per process that `auto` prepares objects without `name`, and why."""
    if (os.getpid(), name) not in _skipped:
        _skipped.add((os.getpid(), name))
        log.warning("rdt_async: auto prepares objects of this process without %s (%s); consumers take another path", name, exc)


def _eager_replies(
    tensors: list[torch.Tensor], transport: str, owner: Process, plan: list[Transport[Any]]
) -> dict[str, Any]:
    """For producers with no `rdt` group (the driver), put the object-store reply now.

    Only where a consumer may need it: explicit object_store, or auto when nothing
    prepared (`plan`) reaches every consumer: node-local transports (shm, cuda_ipc) reach
    only this node (and shm is not prepared where /dev/shm has no room).
    """
    if owner.serves or transport not in (_registry.FALLBACK, _registry.AUTO):
        return {}
    if transport == _registry.AUTO:
        several = _ray.several_nodes()
        if any(t.reach == "cluster" or not several for t in plan):
            return {}
    from .transports.object_store import to_wire

    return {_registry.FALLBACK: _ray.put(to_wire(tensors))}


async def serve_send(obj_id: str, transport: str, request: Any) -> Any:
    """Run the producer's side of a two-sided transfer, asked for by a consumer.

    Runs on: producer (the `rdt` concurrency group, then the I/O loop).
    Raises: ObjectFreedError if the object is gone.
    """
    t = _registry.transport(transport)
    with store.reading(obj_id) as stored:  # a free meanwhile: wait_tensor_freed waits for the send
        if stored is None:
            await t.refuse(obj_id, request)
            raise ObjectFreedError(f"object {obj_id} was freed before it was fetched", obj_id=obj_id)
        meta = next((m for tr, m in stored.prepared.items() if tr.name == transport), None)
        if stored.both_ways(served=True):
            log.warning("rdt_async: %s", shared_with_producer(obj_id))
        return await t.send_multiple_tensors(obj_id, stored.tensors, meta, request)


def serve_free(obj_id: str) -> None:
    """Free an object on request of another process. Runs on: producer."""
    store.free(obj_id)
