"""The verbs: fetch, fetch_all, as_completed, get, put, free, wait_tensor_freed(_sync), stats, transports.

Thin: a fetch's work is `_fetch.py`'s, a put's `_produce.py`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from . import _io, _object, _produce, _ray, _registered, _relay
from ._caller import CALLER, user_line
from ._errors import RDTError, one_chain, release_frames, translating
from ._fetch import abandon, fetch_now, fetch_object
from ._fetched import fetched
from ._object import RDTObject
from ._store import store
from .transports import _registry

F = TypeVar("F", bound=Callable[..., Any])


def _timeout_belongs_to_the_caller(fn: F) -> F:
    """`fn` (an async verb), refusing a `timeout=` at the call with the way to bound it.

    Without this, Python's own "unexpected keyword argument 'timeout'" does not say that
    the caller bounds a fetch with `asyncio.timeout`. Costs one call per fetch.
    """
    verb = fn.__name__
    use = "async for i, value in" if verb == "as_completed" else "await"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "timeout" in kwargs:
            raise TypeError(
                f"rdt.{verb}() takes no timeout: the caller bounds it, "
                f"`async with asyncio.timeout({kwargs['timeout']!r}): {use} rdt.{verb}(...)` "
                "(the transfer is aborted when it expires); rdt.get() takes timeout= in sync code"
            )
        return fn(*args, **kwargs)

    if verb != "as_completed":  # still a coroutine function, to asyncio and inspect alike
        marker = getattr(asyncio.coroutines, "_is_coroutine", None)  # Python 3.11
        if marker is not None:
            call._is_coroutine = marker  # type: ignore[attr-defined]
        mark = getattr(inspect, "markcoroutinefunction", None)  # Python >= 3.12
        if mark is not None:
            mark(call)
    return call  # type: ignore[return-value]


def _check_timeout(timeout: Any, verb: str) -> float | None:
    """`timeout` as seconds (None: no limit). Raises TypeError or ValueError naming the fix."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"rdt.{verb}(timeout=...) takes seconds as a number, or None to wait without limit; "
                        f"not {type(timeout).__name__} {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"rdt.{verb}(timeout={timeout!r}): a timeout is seconds >= 0 (0: do not wait), "
                         "or None to wait without limit")
    return None if math.isinf(timeout) else float(timeout)


@_timeout_belongs_to_the_caller
async def fetch(
    x: Any, /, *, device: str | torch.device | None = None, into: Any = None, tensor_transport: str | None = None
) -> Any:
    """Return the value of an RDT object with real tensors.

    `x` is an ObjectRef or an RDTObject (a ref to a plain value returns that value).
    `device` moves the tensors; `into` is a value, list or tensor whose tensors, in
    order, receive the object's tensors (a dict naming the same tensors as the value,
    keys in another order, is matched by name); `tensor_transport` asks for another transport
    the producer can serve than the one it chose (`"object_store"` always can, as Ray's
    `ray.get(ref, _use_object_store=True)`). The caller's loop never blocks; cancelling
    the fetch (or an enclosing `asyncio.timeout`) aborts the transfer.

    Runs on: consumer.
    Raises: ObjectFreedError, TransferError and its subclasses, TransportUnavailableError
    (also for a `tensor_transport` the producer cannot serve here, naming those it can);
    TypeError for a `timeout=` (bound the fetch with `asyncio.timeout`); ValueError for
    an unknown transport.
    """
    if tensor_transport is not None:
        _registry.check_name(tensor_transport)
    obj = await _resolve(x)
    if not isinstance(obj, RDTObject):
        return obj
    try:
        return await fetch_object(obj, device=device, into=into, tensor_transport=tensor_transport)
    except RDTError as exc:
        one_chain(exc)
        raise


@_timeout_belongs_to_the_caller
async def fetch_all(xs: Iterable[Any], /, *, device: str | torch.device | None = None) -> list[Any]:
    """Fetch many objects concurrently; results in order. One failure cancels the rest.

    Raises: what `fetch` raises; TypeError for a single ref (use `fetch`), a dict (pass its
    values) or a `timeout=`.
    """
    _check_many(xs, "fetch_all")
    xs = list(xs)  # (an iterable that raises midway leaves no fetch started behind)
    caller = CALLER.set(user_line())  # the tasks copy it: a warning names the user's line
    try:
        tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(fetch(x, device=device)) for x in xs]
    finally:
        CALLER.reset(caller)
    return await _all_or_none(tasks)


def _check_many(xs: Any, verb: str) -> None:
    if _ray.is_ref(xs) or isinstance(xs, (RDTObject, str, bytes)) or not isinstance(xs, Iterable):
        raise TypeError(
            f"rdt.{verb}() takes an iterable of ObjectRefs or RDTObjects, not {type(xs).__name__}; "
            f"for one, `await rdt.fetch(ref)`"
        )
    if isinstance(xs, Mapping):
        raise TypeError(
            f"rdt.{verb}() takes an iterable of ObjectRefs or RDTObjects, not a dict (that would fetch its "
            "keys): pass d.values(), whose i-th is the value of list(d)[i], as in "
            "dict(zip(d, await rdt.fetch_all(d.values())))"
        )


async def _all_or_none(tasks: list[asyncio.Future[Any]]) -> list[Any]:
    """Await every task, results in order; one failure (or a cancel) cancels the rest.

    On failure `tasks` is emptied: the error's traceback keeps this frame, which must not
    keep the values fetched meanwhile (and with them their producers' tensors).
    """
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        # No name in this frame may keep a task or the error when it propagates: the
        # error's traceback keeps the frame, a task keeps the error, a cycle that holds
        # the callers' refs and values until the GC runs.
        _cancel(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        _release(tasks, exc)
        tasks.clear()
        del exc
        raise


def _cancel(tasks: Iterable[asyncio.Future[Any]]) -> None:
    for t in tasks:
        t.cancel()


def _release(tasks: Iterable[asyncio.Future[Any]], exc: BaseException | None) -> None:
    """Clear the frames of failed fetches: each holds its RDTObject in a cycle with its
    exception, which would keep the producer's tensors until this process's GC ran."""
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            release_frames(t.exception())  # type: ignore[arg-type]
    if exc is not None:
        release_frames(exc)


async def fetch_objects(objs: list[RDTObject], where: tuple[str, int, dict[str, Any]] | None = None) -> list[Any]:
    """Fetch RDT objects in hand (a method's arguments): those that cannot block (inline,
    small local maps) on this thread at once, the others concurrently; one failure
    cancels the rest. `where`: the method's (file, line, globals), for warnings."""
    try:
        return await _fetch_objects(objs, where)
    except RDTError as exc:
        one_chain(exc)
        raise


async def _fetch_objects(objs: list[RDTObject], where: tuple[str, int, dict[str, Any]] | None) -> list[Any]:
    values: list[Any] = [None] * len(objs)
    later: dict[int, Any] = {}
    caller = CALLER.set(where)  # (the tasks copy it)
    try:
        for i, obj in enumerate(objs):
            done, got = fetch_now(obj, device=None, into=None)
            if done:
                values[i] = got
            else:
                later[i] = got  # where the fetch goes on from
        tasks: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(fetch_object(objs[i], device=None, into=None, start=s)) for i, s in later.items()
        ]
    finally:
        CALLER.reset(caller)
    if later:
        try:
            fetched = await _all_or_none(tasks)
        except BaseException:
            values.clear()  # (as `_all_or_none` does: this frame stays in the error's traceback)
            later.clear()
            raise
        for i, value in zip(later, fetched):
            values[i] = value
    return values


@_timeout_belongs_to_the_caller
async def as_completed(
    xs: Iterable[Any], /, *, device: str | torch.device | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """Fetch many objects concurrently; yield `(index, value)` as each lands.

    Leaving the loop early cancels the fetches still in flight once the generator is
    closed: at once with `async with contextlib.aclosing(rdt.as_completed(xs)) as it`, or
    when it is collected (a loop over `rdt.as_completed(xs)` itself: the next loop turn;
    one kept in a variable: not before the variable goes).
    Raises: what `fetch` raises; TypeError for a single ref (use `fetch`), a dict (pass its
    values) or a `timeout=`.
    """
    _check_many(xs, "as_completed")
    xs = list(xs)  # as in fetch_all
    caller = CALLER.set(user_line())  # as in fetch_all
    try:
        tasks = {asyncio.ensure_future(fetch(x, device=device)): i for i, x in enumerate(xs)}
    finally:
        CALLER.reset(caller)
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=tasks.__getitem__):
                yield tasks[t], t.result()
    finally:
        _cancel(pending)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        _release(tasks, None)
        # As in `_all_or_none`: an error's traceback may keep this frame, so its names
        # must not keep the tasks (and their values).
        tasks.clear()
        pending = done = set()
        t = None  # type: ignore[assignment]


def get(
    x: Any,
    /,
    *,
    timeout: float | None = None,
    device: str | torch.device | None = None,
    into: Any = None,
    tensor_transport: str | None = None,
) -> Any:
    """Blocking twin of `fetch`, for the driver and sync actors.

    Raises: RuntimeError on a thread that runs an event loop (use `await rdt.fetch`),
    TimeoutError after `timeout` seconds (the transfer is aborted), TypeError or ValueError
    for a timeout that is not seconds >= 0 or None, and what `fetch` raises.
    """
    timeout = _check_timeout(timeout, "get")
    if tensor_transport is not None:
        _registry.check_name(tensor_transport)
    try:
        return _get(x, timeout, device, into, tensor_transport)
    except RDTError as exc:
        one_chain(exc)
        raise


def _get(x: Any, timeout: float | None, device: str | torch.device | None, into: Any, asked: str | None = None) -> Any:
    loop = _io.running_loop()
    if loop is not None:
        raise RuntimeError(
            "rdt.get() would block the event loop running in this thread; "
            "use `await rdt.fetch(ref)` here instead"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    if _ray.is_ref(x):  # resolve here: a plain ray.get beats a hop through the I/O loop
        with translating(f"resolving {x}", user_code=True):
            x = _ray.get_ref(x, timeout)
        if not isinstance(x, RDTObject):
            return x  # a ref to a plain value
    elif not isinstance(x, RDTObject):
        raise _not_rdt(x, "get")
    done, value = fetch_now(x, device=device, into=into, tensor_transport=asked)
    if done:
        return value
    # Timed out or interrupted (Ctrl-C), `result` aborts the fetch and returns once the
    # transport let go: nothing writes `into` afterwards.
    started = _io.Started(fetch_object(x, device=device, into=into, start=value, tensor_transport=asked))
    try:
        return started.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError as exc:
        if started.done() and not started.future.cancelled():
            raise  # the fetch's own
        raise TimeoutError(f"rdt.get() timed out after {timeout} s; the transfer was aborted") from exc
    finally:
        if started.task is None:  # never ran (given up before it began): its claim on `into` is let go here
            abandon(value)  # (a running one lets go itself, once nothing writes `into` any more)
        del started, value  # its future holds the error, whose traceback holds this frame: break the cycle


def put(value: Any, /, *, tensor_transport: str = "auto") -> Any:
    """Keep the tensors of `value` in this process and return an ObjectRef to them.

    Runs on: producer (driver or actor). Others fetch the ref like a method's result.
    Raises: ValueError for an unknown transport, TransportUnavailableError for tensors
    the transport cannot move.
    """
    _registry.check_name(tensor_transport)
    return _ray.put(_produce.produce(value, tensor_transport))


def free(x: Any, /) -> None:
    """Release an object's tensors now; later fetches raise ObjectFreedError.

    Later fetches in this process raise at once; in others, once the producer has freed
    it (called away from the producer, this sends it a message and does not wait).

    Never blocks for an RDTObject; an ObjectRef is resolved first with `ray.get` (a small
    object, but a blocking call): on an event loop, pass `await ref` instead.
    """
    if _ray.is_ref(x) and _io.running_loop() is not None:
        raise RuntimeError(
            "rdt.free(ref) would block the event loop running in this thread to resolve the ref; "
            "use `rdt.free(await ref)` here instead"
        )
    obj = x if isinstance(x, RDTObject) else _ray.get_ref(x, None) if _ray.is_ref(x) else x
    if not isinstance(obj, RDTObject):
        raise TypeError(f"rdt.free() takes an RDT object or a ref to one, not {type(obj).__name__}")
    if obj.anchor is None:  # nothing is kept for it anywhere (inline, or no tensors)
        _object.forget(obj)
        return
    if _object.is_local(obj):
        store.free(obj.obj_id)
        return
    if obj.specs:
        _ray.free_remote(obj)  # raises, marking nothing, where this process may not free it
    store.mark_freed(obj.obj_id)


async def wait_tensor_freed(tensor: torch.Tensor, /) -> None:
    """Wait until writing `tensor` in place cannot change what any consumer reads.

    That is: no object of this process holds any byte of `tensor` (every ref to them is
    gone), none is being made of it (a producing call that has returned but not finished
    its export), and no send or collective is reading it. Call it before writing a
    tensor you returned or put. Runs on: producer. Bound it with `asyncio.timeout`.
    Raises: TypeError for a non-tensor.
    """
    await store.wait_freed(_check_tensor(tensor, "wait_tensor_freed"))


def wait_tensor_freed_sync(tensor: torch.Tensor, /, *, timeout: float | None = None) -> None:
    """Blocking twin of `wait_tensor_freed`, for sync and threaded actors and the driver.

    Runs on: producer. Raises: TypeError for a non-tensor; RuntimeError on a thread that
    runs an event loop (use `await rdt.wait_tensor_freed` there); TimeoutError after
    `timeout` seconds; TypeError or ValueError for a timeout that is not seconds >= 0 or None.
    """
    _check_tensor(tensor, "wait_tensor_freed_sync")
    timeout = _check_timeout(timeout, "wait_tensor_freed_sync")
    if _io.running_loop() is not None:
        raise RuntimeError(
            "rdt.wait_tensor_freed_sync() would block the event loop running in this thread; "
            "use `await rdt.wait_tensor_freed(tensor)` here instead"
        )
    if not store.wait_freed_blocking(tensor, timeout):
        raise TimeoutError(f"rdt.wait_tensor_freed_sync(): the tensor is still held after {timeout} s")


def _check_tensor(tensor: Any, verb: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rdt.{verb}() takes a tensor this process returned or put, not {type(tensor).__name__}")
    return tensor


def store_stats() -> dict[str, Any]:
    """Return what this process's store holds: objects, bytes, tensors, fetches by transport,
    its node relay's work and holdings (`relay`), its publications and subscriptions
    (versions, skipped, lag, apply time), and the memory registered with each transport
    that registers memory (`registered`: storages and bytes now, those `rdt.register_memory`
    holds, and the registrations and deregistrations made so far)."""
    from . import _publish

    return {
        **store.stats(), **fetched.stats(), "relay": _relay.stats(), **_publish.stats(), "registered": _registered.stats()
    }


def register_transport(name: str, devices: Sequence[str], cls: type) -> None:
    """Add a transport under `name` for tensors on `devices`, for every process of the cluster.

    `cls` is an `rdt.Transport` subclass, or a Ray `TensorTransportManager` subclass (run
    through an adapter). Call it in the driver, before or after `ray.init()` and before or
    after creating actors: every process looks the name up when it first meets it. A class
    defined in a script or test module travels by value.

    Raises: TypeError for a non-class, a class of neither kind, or one missing required
    methods (named); ValueError for a built-in or malformed name, devices that are not torch
    device types or that the class does not declare, or a name taken by another class.
    """
    _registry.register(name, devices, cls)


def available_transports() -> dict[str, bool | str]:
    """Return transport name -> True, or why it cannot be used in this process."""
    return _registry.available()


async def _resolve(x: Any) -> Any:
    if isinstance(x, RDTObject):
        return x
    if _ray.is_ref(x):
        with translating(f"resolving {x}", user_code=True):
            return await _ray.await_ref(x)
    raise _not_rdt(x, "fetch")


def _not_rdt(x: Any, verb: str) -> TypeError:
    many = ""
    if isinstance(x, (list, tuple, set, dict)):
        many = ("; for many, `await rdt.fetch_all(refs)`" if verb == "fetch"
                else "; for many, `[rdt.get(r) for r in refs]`, or `await rdt.fetch_all(refs)` on a loop")
    return TypeError(f"rdt.{verb}() takes an ObjectRef or an RDTObject, not {type(x).__name__}{many}")
