"""remote() and method(): producer wrapping, argument auto-fetch, the `rdt` group.

`rdt.remote` builds a subclass of the user's class in which
- methods marked with `rdt.method` keep the tensors of their return value here and
  return an RDTObject;
- every method receives its top-level RDTObject arguments already fetched (on the
  actor's loop for async methods, on the I/O thread for sync ones);
- control methods (`rdt__send`, `rdt__free`, `rdt__group`, `rdt__anchors`) run in
  the `rdt` concurrency group, so transfers are served while user methods are busy or
  queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import inspect
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from . import _api, _io, _object, _produce, _ray, collective
from .transports import _registry

if TYPE_CHECKING:
    from .collective._messages import Message

RDT_GROUP = "rdt"
RDT_GROUP_CONCURRENCY = 8  # transfers served at once; also bounds group operations in sync actors
# Async actors: subscribers' waits for a new version (_publish.py), each a coroutine that
# mostly sleeps; their own group, so that they never hold up the transfers of `rdt`.
PUBLISH_GROUP, PUBLISH_GROUP_CONCURRENCY = "rdt_publish", 1024
OWN_GROUPS = (RDT_GROUP, PUBLISH_GROUP)  # no method of the user's runs in them
CONTROL_METHODS = ("rdt__send", "rdt__free", "rdt__group", "rdt__anchors", "rdt__ping", "rdt__publication")

F = TypeVar("F", bound=Callable[..., Any])


def method(fn: F | None = None, /, *, tensor_transport: str = "auto", **ray_method_opts: Any) -> Any:
    """Mark an actor method as a producer: tensors in its return value stay in this actor.

    Use as ``@rdt.method`` or ``@rdt.method(tensor_transport="shm", concurrency_group=...)``;
    other options go to `ray.method`. Its ObjectRef resolves to an RDTObject. One call
    picks another transport with ``actor.name.options(tensor_transport=...).remote()``.
    Decorators above it apply to each call. Called by the actor's own code
    (``self.name()``, ``super().name()``, in a method's body or a task it starts), it runs
    as written and returns its value, as under Ray: only a call through a handle keeps the
    tensors and returns an RDTObject. From another thread (``run_in_executor``, a pool, a
    ``threading.Thread``; ``asyncio.to_thread`` carries the context and is inside) the
    call counts as a handle's and returns an RDTObject.
    Raises: ValueError at decoration for an unknown transport, naming the available ones,
    for num_returns=0, and for rdt_async's own concurrency groups ("rdt", "rdt_publish").
    """
    if isinstance(fn, str):
        raise TypeError(f"@rdt.method({fn!r}): name the transport, @rdt.method(tensor_transport={fn!r})")
    _registry.check_name(tensor_transport)
    if "tensor_transport" in ray_method_opts:
        raise TypeError("pass tensor_transport once")
    _refuse_own_group(ray_method_opts.get("concurrency_group"), "@rdt.method")
    if ray_method_opts.get("num_returns") == 0:
        raise ValueError(
            "@rdt.method(num_returns=0): nothing the method returns would reach a consumer; drop "
            "num_returns=0, or the @rdt.method if it returns no tensors"
        )

    def mark(f: F) -> F:
        if isinstance(f, type):
            raise TypeError(
                f"@rdt.method marks methods, not the class {f.__name__}: decorate the class with @rdt.remote "
                "and its methods that return tensors with @rdt.method"
            )
        if isinstance(f, (staticmethod, classmethod)):
            raise TypeError(
                f"@rdt.method marks methods of an actor's instance, not a {type(f).__name__}: "
                "drop the @" + type(f).__name__ + " (an actor's results come from its instance)"
            )
        if not callable(f):
            raise TypeError(f"@rdt.method decorates methods, not {type(f).__name__}")
        if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
            raise TypeError(
                f"@rdt.method cannot make the generator {f.__qualname__} a producer: Ray 2.60 loses the "
                "references inside yielded values (ray-project/ray#58080), so their tensors would be "
                "freed before they are fetched; return a list, or a tuple with num_returns=N"
            )
        if ray_method_opts:
            # On `f` itself, checked now: Ray reads a method's options from the function
            # under the wrappers (`inspect.unwrap`), not from the wrapper it calls.
            ray.method(**ray_method_opts)(f)
        f.__rdt_transport__ = tensor_transport  # type: ignore[attr-defined]
        return _guard(f)

    return mark(fn) if fn is not None else mark


def _guard(f: F) -> F:
    """What `@rdt.method` leaves in the class: `@rdt.remote` wraps it (with the decorators
    above it) into the producer Ray calls.

    Called on an instance of an `@rdt.remote` class it runs `f`: the producer's own call
    (through those decorators), or the actor's code calling the method as written
    (`super().weights()`, `Base.weights(self)`). Called on anything else, the class was
    decorated with `@ray.remote`, which knows nothing of producers: the tensors would
    silently go through Ray's object store. Same kind (async or not) as `f`, so that Ray
    still tells an async actor from a sync one.
    """
    def refuse(self: Any) -> TypeError:
        return TypeError(
            f"@rdt.method {f.__qualname__} runs in a class decorated with @ray.remote, which "
            f"ignores it (its tensors would go through Ray's object store): decorate "
            f"{type(self).__name__} with @rdt.remote instead"
        )

    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def guard(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _in_rdt_actor(self):
                raise refuse(self)
            return await f(self, *args, **kwargs)

    else:

        @functools.wraps(f)
        def guard(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _in_rdt_actor(self):
                raise refuse(self)
            return f(self, *args, **kwargs)

    guard.__rdt_method__ = f  # type: ignore[attr-defined]
    return guard  # type: ignore[return-value]


def _in_rdt_actor(obj: Any) -> bool:
    return getattr(type(obj), "__rdt_wrapped__", None) is not None


def remote(cls: type | None = None, /, **options: Any) -> Any:
    """`ray.remote` for actor classes, with RDT producers, auto-fetch and the `rdt` group.

    Use as ``@rdt.remote`` or ``@rdt.remote(num_cpus=1, max_concurrency=4, ...)``; every
    option goes to `ray.remote`. Works for sync, threaded and async actors.
    Raises: TypeError for a function (use ray.remote for tasks), a class already under
    @ray.remote, a staticmethod, classmethod or property over an @rdt.method, and for what
    would hand transfers to Ray's own RDT (enable_tensor_transport=True, a method with
    @ray.method(tensor_transport=...)); ValueError if the options already define a
    concurrency group named "rdt" or "rdt_publish", if a method asks for one of those or
    for a group the class does not declare, for an @rdt.method with num_returns=0, or if
    its methods return over two transports that cannot load in one process
    (`Transport.clashes_with`: nixl and ucxx).
    """
    if cls is None:
        return lambda c: remote(c, **options)
    if isinstance(cls, ray.actor.ActorClass):
        name = cls.__ray_metadata__.class_name  # type: ignore[attr-defined]
        raise TypeError(
            f"@rdt.remote over @ray.remote on {name}: drop the @ray.remote (@rdt.remote makes the "
            "Ray actor class itself, and takes ray.remote's options)"
        )
    if not isinstance(cls, type):
        raise TypeError(
            f"@rdt.remote decorates actor classes, not {type(cls).__name__}; "
            "tasks cannot keep tensors, use ray.remote for them"
        )
    declared = options.pop("concurrency_groups", None)
    if declared is not None and not isinstance(declared, Mapping):
        raise TypeError(
            f"concurrency_groups takes a dict of group names and their max concurrency, such as "
            f"concurrency_groups={{'io': 2}}, not a {type(declared).__name__}"
        )
    groups = dict(declared or {})
    for own in OWN_GROUPS:
        if own in groups:
            raise ValueError(
                f"the concurrency group {own!r} is rdt_async's own (it serves transfers); "
                "rename yours"
            )
    if options.get("enable_tensor_transport"):
        raise TypeError(
            f"@rdt.remote(enable_tensor_transport=True) on {cls.__name__} would hand its transfers to Ray's own "
            "RDT, bypassing rdt_async: drop the option (every rdt.remote actor may receive refs) and mark "
            "producers @rdt.method(tensor_transport=...); one call picks another with "
            "actor.method.options(tensor_transport=...)"
        )
    methods = _user_methods(cls)
    for name, attr in methods.items():
        _check_method(f"{cls.__name__}.{name}", attr, groups)
    _check_clashes(cls, methods)
    _install_per_call()
    for name in CONTROL_METHODS:
        if hasattr(cls, name):
            raise ValueError(f"{cls.__name__}.{name} clashes with rdt_async's control method; rename it")
    wrapped = _wrap_class(cls)
    groups[RDT_GROUP] = RDT_GROUP_CONCURRENCY
    if "rdt__publication" in vars(wrapped):  # an async actor
        groups[PUBLISH_GROUP] = PUBLISH_GROUP_CONCURRENCY
    make: Any = ray.remote  # its typed overloads name no **options
    return make(concurrency_groups=groups, **options)(wrapped)


def _check_method(where: str, attr: Callable[..., Any], groups: Mapping[str, int]) -> None:
    """Refuse, at decoration, a method whose `ray.method` options would fail (or mislead) later."""
    opts = _ray_options(attr)
    ray_transport = opts.get("__ray_tensor_transport__")
    if ray_transport is not None:
        raise TypeError(
            f"{where} has @ray.method(tensor_transport={ray_transport.lower()!r}), which would hand "
            f"its return to Ray's own RDT, bypassing rdt_async: use @rdt.method(tensor_transport="
            f"{ray_transport.lower()!r}) instead"
        )
    group = opts.get("__ray_concurrency_group__")
    _refuse_own_group(group, where)
    if group is not None and group not in groups:
        declared = ", ".join(map(repr, groups)) or "none"
        raise ValueError(
            f"{where} runs in the concurrency group {group!r}, which its class does not declare "
            f"(it declares {declared}): add it, @rdt.remote(concurrency_groups={{{group!r}: 1}})"
        )
    if _producer_body(attr) is not None and opts.get("__ray_num_returns__") == 0:
        raise ValueError(
            f"{where} is an @rdt.method with num_returns=0, so nothing it returns would reach a consumer: "
            "drop num_returns=0, or the @rdt.method if it returns no tensors"
        )


def _refuse_own_group(group: Any, where: str) -> None:
    if group in OWN_GROUPS:
        raise ValueError(
            f"{where}: the concurrency group {group!r} is rdt_async's own (it serves transfers, which a method "
            "of yours there would hold up): declare one of yours, @rdt.remote(concurrency_groups={'io': 2}), "
            "and name that"
        )


def _check_clashes(cls: type, methods: dict[str, Callable[..., Any]]) -> None:
    """Refuse a class whose methods return over two transports that cannot load in one process."""
    named = {getattr(_producer_body(f), "__rdt_transport__", None): name for name, f in methods.items()}
    for transport, method in named.items():
        known = _registry.known_class(transport) if transport is not None else None
        for other in sorted(known.clashes_with & named.keys()) if known is not None else ():
            raise ValueError(
                f"{cls.__name__}.{method} returns over {transport!r} and {cls.__name__}.{named[other]} over "
                f"{other!r}, which cannot load in one process (their native libraries clash): return one of "
                "them from an actor of another class, or return both over one transport"
            )


def _wrap_class(cls: type) -> type:
    methods = _user_methods(cls)
    namespace: dict[str, Any] = {}
    for name, attr in methods.items():
        namespace[name] = _wrap_method(name, attr)
    transports = [
        t for attr in methods.values() if (t := getattr(_producer_body(attr), "__rdt_transport__", None)) is not None
    ]
    namespace["__init__"] = _warming_init(cls, namespace.get("__init__"), transports)
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    namespace["__doc__"] = cls.__doc__
    namespace["__rdt_wrapped__"] = cls
    out = type(cls.__name__, (cls,), namespace)
    # Async as Ray decides it (any member, inherited, static or dunder, an `async def`):
    # the control methods are of that kind, and add nothing to the answer.
    for name, control in _control_methods(bool(inspect.getmembers(out, _is_async))).items():
        setattr(out, name, control)
    return out


def _warming_init(cls: type, init: Callable[..., Any] | None, transports: list[str]) -> Callable[..., Any]:
    """`init` (the class's own, wrapped; else what `cls.__init__` is: a C type's, object's),
    after loading the transports the actor's methods produce over, and the one `auto` is
    likely to need (see `_produce.at_creation`), with the I/O loop and pool threads started
    (`_io.prestart`), and what the process holds by then frozen out of the garbage
    collector's scans (`_freeze_gc`)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _install_per_call()  # this actor's own calls with .options(tensor_transport=...)
        _ray.warm_serialization()
        _produce.warm_up(_produce.at_creation(transports), named=transports)
        _io.prestart()  # a first transfer starts no thread on the actor's loop
        _freeze_gc()  # before the class's own __init__: what that makes is collected as usual
        if init is not None:
            init(self, *args, **kwargs)
        else:
            cls.__init__(self, *args, **kwargs)  # type: ignore[misc]

    return functools.wraps(init)(__init__) if init is not None else __init__


def _freeze_gc() -> None:
    """Leave what the process holds before the actor's own `__init__` out of later full collections.

    A process with torch and Ray loaded tracks ~10^6 objects: a full collection of them
    holds the GIL ~0.1 s, whatever thread it falls on, and the actor's loop stalls that
    long. Frozen (`gc.freeze`), they are skipped (still freed when their last reference
    goes; only a cycle among them would never be collected). What `__init__` makes (a
    model, a module hooking its own method: cycles a later reload lets go of) is not
    frozen. `RDT_GC_FREEZE=0` keeps Python's default.
    """
    global _frozen_in
    if os.environ.get("RDT_GC_FREEZE", "1") != "0" and _frozen_in != os.getpid():
        _frozen_in = os.getpid()  # once: an actor's own `self.__init__()` (a reset) freezes nothing it made
        gc.collect()
        gc.freeze()


_frozen_in: int | None = None  # the process whose objects `_freeze_gc` froze


def _user_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The methods of `cls` that rdt_async wraps, by name: the attribute each name has in
    `cls` (the most derived class's, as Python looks it up), where that is a function.
    Anything else (a staticmethod, a property, a `functools.partialmethod`, None) stays as
    the class has it.

    Raises: TypeError for a staticmethod, classmethod or property (or other wrapper that is
    no function) over an @rdt.method: Ray could not call it as a producer.
    """
    out: dict[str, Callable[..., Any]] = {}
    seen: set[str] = set()
    for klass in cls.__mro__[:-1]:  # (not object's)
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if not inspect.isfunction(attr):
                _refuse_hidden_producer(cls, name, attr)
                continue
            if name.startswith("__") and name not in ("__init__", "__call__"):
                continue
            out[name] = attr
    return out


def _refuse_hidden_producer(cls: type, name: str, attr: Any) -> None:
    under = (attr, getattr(attr, "__func__", None), getattr(attr, "fget", None), getattr(attr, "func", None))
    if not any("__rdt_method__" in getattr(u, "__dict__", {}) for u in under if u is not None):
        return
    kind = type(attr).__name__
    fix = (
        f"drop the @{kind} (an actor's producers are methods of its instance)"
        if isinstance(attr, (staticmethod, classmethod, property))
        else "put @rdt.method outermost"
    )
    raise TypeError(f"{cls.__name__}.{name} is a {kind} over an @rdt.method, which Ray cannot call as a producer: {fix}")


def _producer_body(attr: Any) -> Callable[..., Any] | None:
    """The method under `attr`'s @rdt.method (decorators above it copy the mark), or None."""
    return getattr(attr, "__rdt_method__", None)


def _ray_options(attr: Callable[..., Any]) -> dict[str, Any]:
    """A method's `ray.method` options, from each decorator's layer of it (the outermost's
    win): one above @rdt.method (or another decorator) set them on its own layer."""
    layers = [attr]
    while hasattr(layers[-1], "__wrapped__") and len(layers) < 100:
        layers.append(layers[-1].__wrapped__)
    out: dict[str, Any] = {}
    for layer in reversed(layers):
        out.update((k, v) for k, v in getattr(layer, "__dict__", {}).items() if k.startswith("__ray_"))
    return out


def _is_async(f: Any) -> bool:
    return inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)


# Set while the actor's own code runs (a method's body, in its thread or task and the
# tasks that start from it): a method it calls (`self.weights()`) runs as written, as
# under Ray. Unset where Ray calls a method for a call through a handle.
_own_code: contextvars.ContextVar[bool] = contextvars.ContextVar("rdt_own_code", default=False)


def _in_own_code() -> bool:  # (the wrappers, pickled with the class, call this: a ContextVar does not pickle)
    return _own_code.get()


def _as_own(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` as the actor's own code."""
    token = _own_code.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _own_code.reset(token)


async def _as_own_async(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`await fn(*args, **kwargs)` as the actor's own code (a sync decorator over an
    `async def` returns its coroutine: awaited too)."""
    token = _own_code.set(True)
    try:
        value = fn(*args, **kwargs)
        return await value if inspect.isawaitable(value) else value
    finally:
        _own_code.reset(token)


def _wrap_method(name: str, attr: Callable[..., Any]) -> Callable[..., Any]:
    """What Ray calls for the method `attr` (as the class has it, decorators and all): its
    top-level RDT arguments fetched first; a producer's value kept here, an RDTObject
    returned. Called by the actor's own code, it runs `attr` as written."""
    body = _producer_body(attr)
    f = attr if body is None else body  # as written: its kind, its transport
    # Ray reads a method's options and signature from the function under every wrapper
    # (`inspect.unwrap`): those set above it go there, and a producer's per-call transport.
    inner = inspect.unwrap(attr)
    for key, value in _ray_options(attr).items():
        setattr(inner, key, value)
    site = inner if inspect.isfunction(inner) else attr  # a warning names its line
    default: str | None = getattr(f, "__rdt_transport__", None)
    returns = getattr(inner, "__ray_num_returns__", None)
    split = isinstance(returns, int) and returns > 1  # one RDTObject per return
    wrapped: Callable[..., Any]

    def parts(value: Any) -> Any:
        if not isinstance(value, (tuple, list)) or len(value) != returns:
            raise ValueError(
                f"{f.__qualname__} has num_returns={returns}: return a tuple of {returns} values, "
                f"not {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
            )
        return value

    def produce(value: Any, transport: str) -> Any:
        if split:
            with _produce.holding(value):  # every part waits for wait_tensor_freed, not only the first
                return tuple(_produce.produce(v, transport) for v in parts(value))
        return _produce.produce(value, transport)

    async def produce_async(value: Any, transport: str) -> Any:
        if split:
            with _produce.holding(value):
                return tuple([await _produce.produce_async(v, transport) for v in parts(value)])
        return await _produce.produce_async(value, transport)

    if inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(attr):

        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _in_own_code():
                return await _as_own_async(attr, self, *args, **kwargs)
            transport = _chosen(kwargs, default, self, f)
            args, kwargs = await _fetch_args(args, kwargs, site)
            value = await _as_own_async(attr, self, *args, **kwargs)
            return value if transport is None else await produce_async(value, transport)

    elif inspect.isasyncgenfunction(attr):

        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _in_own_code():
                args, kwargs = await _fetch_args(args, kwargs, site)
            steps = attr(self, *args, **kwargs)
            try:
                step: tuple[Callable[[Any], Any], Any] = (steps.asend, None)
                while True:  # (`async for` as the caller drives it: asend and athrow reach `steps`)
                    try:
                        value = await _as_own_async(*step)
                    except StopAsyncIteration:
                        return
                    try:
                        step = (steps.asend, (yield value))  # never a producer (see `method`)
                    except GeneratorExit:
                        raise
                    except BaseException as e:  # (handed to `steps`, as `yield from` would)
                        step = (steps.athrow, e)
            finally:
                await steps.aclose()

    elif inspect.isgeneratorfunction(attr):

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _in_own_code():
                args, kwargs = _fetch_args_blocking(args, kwargs, site)
            with contextlib.closing(attr(self, *args, **kwargs)) as steps:
                step: tuple[Callable[[Any], Any], Any] = (steps.send, None)
                while True:  # (`yield from`, each step as the actor's own code: send, throw, the return value)
                    try:
                        value = _as_own(*step)
                    except StopIteration as stop:
                        return stop.value
                    try:
                        step = (steps.send, (yield value))  # never a producer (see `method`)
                    except GeneratorExit:
                        raise
                    except BaseException as e:  # (handed to `steps`, as `yield from` would)
                        step = (steps.throw, e)

    elif name == "__init__":

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            # An async actor runs __init__ on its loop, which serves nothing until it
            # returns: blocking it for the arguments stalls no other call.
            args, kwargs = _fetch_args_blocking(args, kwargs, site, on_loop_ok=True)
            return _as_own(attr, self, *args, **kwargs)

    else:

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _in_own_code():
                return _as_own(attr, self, *args, **kwargs)
            transport = _chosen(kwargs, default, self, f)
            args, kwargs = _fetch_args_blocking(args, kwargs, site)
            value = _as_own(attr, self, *args, **kwargs)
            return value if transport is None else produce(value, transport)

    if default is not None:
        # On `inner`: Ray reads a method's signature from the function under the wrappers
        # (as it adds its own `_ray_trace_ctx` there), and checks calls against it.
        inner.__signature__ = _with_per_call(inner, default)
    return functools.wraps(attr)(wrapped)  # with `attr`'s attributes and `__wrapped__`


# A producer's per-call transport travels to it as this keyword argument, which its
# signature (the one Ray checks a call against) takes, defaulting to the method's own.
PER_CALL = "_rdt_tensor_transport"


def _chosen(kwargs: dict[str, Any], default: str | None, actor: Any, f: Callable[..., Any]) -> str | None:
    """Take the per-call transport out of a producer's keyword arguments (its own if none),
    refusing, before the method's body runs, one this actor cannot produce over.

    Raises: TransportUnavailableError (a two-sided transport without a group).
    """
    if default is None:
        return None
    chosen = kwargs.pop(PER_CALL, None)
    name = default if chosen is None else str(chosen)
    _produce.check_grouped(name, f"{type(actor).__name__}.{f.__name__} produces over tensor_transport={name!r}, "
                           "and was refused before it ran")
    return name


class _Default(str):
    """A producer's transport as its signature's default: unpickled in a process (with
    the class, or a handle), it installs the hook that lets `.options(tensor_transport=...)`
    of that process's calls reach rdt_async."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_default, (str(self),))


def _default(name: str) -> _Default:
    _install_per_call()
    return _Default(name)


def _with_per_call(f: Callable[..., Any], default: str) -> inspect.Signature:
    sig = inspect.signature(f)
    params = [p for p in sig.parameters.values() if p.name != PER_CALL]  # (a class wrapped twice)
    extra = inspect.Parameter(PER_CALL, inspect.Parameter.KEYWORD_ONLY, default=_Default(default))
    at = len(params) - (1 if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD else 0)
    return sig.replace(parameters=[*params[:at], extra, *params[at:]])


def _install_per_call() -> None:
    """Let `actor.method.options(tensor_transport=...)` pick an `@rdt.method`'s transport for one call.

    Ray's `ActorMethod.options` hands a tensor_transport to Ray's own RDT (and refuses it
    for actors without enable_tensor_transport): for the methods of `rdt.remote` actors,
    the option goes to rdt_async instead, and rdt_async's own concurrency groups are
    refused. Every other call is Ray's, untouched.
    """
    from ray.actor import ActorMethod

    ray_options = ActorMethod.options
    if getattr(ray_options, "__rdt_per_call__", False):
        return

    @functools.wraps(ray_options)
    def options(self: Any, **opts: Any) -> Any:
        if _of_rdt_actor(self):
            if self._method_name not in CONTROL_METHODS:
                _refuse_own_group(opts.get("concurrency_group"), f"{self._method_name}.options(...)")
            if "tensor_transport" in opts:
                return _PerCall(self, opts.pop("tensor_transport"), opts)
        return ray_options(self, **opts)

    options.__rdt_per_call__ = True  # type: ignore[attr-defined]
    ActorMethod.options = options  # type: ignore[method-assign]


def _of_rdt_actor(m: Any) -> bool:
    return "rdt__send" in (getattr(getattr(m, "_actor", None), "_method_shells", None) or ())


class _PerCall:
    """`actor.method.options(tensor_transport=...)` of an `@rdt.method`: `.remote()` as Ray's."""

    def __init__(self, m: Any, transport: Any, opts: dict[str, Any]) -> None:
        name = m._method_name
        if not any(p.name == PER_CALL for p in m._signature or ()):
            raise TypeError(
                f"{name}.options(tensor_transport={transport!r}): {name} is not an @rdt.method, so rdt_async "
                f"keeps nothing of its return value and there is no transport to choose; mark it "
                f"@rdt.method to keep its tensors in the actor"
            )
        if not isinstance(transport, str):
            raise TypeError(f"{name}.options(tensor_transport=...) takes a transport's name, not {type(transport).__name__}")
        self._method, self._transport, self._opts = m, _registry.check_name(transport), opts

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method once, its tensors kept over the chosen transport."""
        if PER_CALL in kwargs:
            raise TypeError(f"{PER_CALL} is rdt_async's own: use .options(tensor_transport=...)")
        return self._method._remote(args=args, kwargs={**kwargs, PER_CALL: self._transport}, **self._opts)


def _rdt_positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | str]:
    found: list[int | str] = [i for i, a in enumerate(args) if isinstance(a, _object.RDTObject)]
    found += [k for k, v in kwargs.items() if isinstance(v, _object.RDTObject)]
    return found


async def _fetch_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], f: Callable[..., Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fetch top-level RDTObject arguments of method `f` concurrently (a warning names `f`'s line)."""
    where = _rdt_positions(args, kwargs)
    if not where:
        return args, kwargs
    new_args, new_kwargs = list(args), dict(kwargs)
    code = f.__code__
    values = await _api.fetch_objects(
        [args[w] if isinstance(w, int) else kwargs[w] for w in where], (code.co_filename, code.co_firstlineno, f.__globals__)
    )
    for w, v in zip(where, values):
        if isinstance(w, int):
            new_args[w] = v
        else:
            new_kwargs[w] = v
    return tuple(new_args), new_kwargs


def _fetch_args_blocking(
    args: tuple[Any, ...], kwargs: dict[str, Any], f: Callable[..., Any], *, on_loop_ok: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not _rdt_positions(args, kwargs):
        return args, kwargs
    if not on_loop_ok and _io.running_loop() is not None:
        raise RuntimeError(
            "a sync method of an async actor received an RDT object: make the method "
            "`async def` so its arguments can be fetched without blocking the loop"
        )
    return _io.start(_fetch_args(args, kwargs, f)).result()


def _control_methods(is_async: bool) -> dict[str, Any]:
    """The methods of the `rdt` group, async for async actors (Ray runs the group on its
    own loop) and sync for the others (the group's own threads)."""
    group = ray.method(concurrency_group=RDT_GROUP)
    if is_async:

        async def rdt__send(self: Any, obj_id: str, transport: str, request: Any) -> Any:
            return await _io.start(_produce.serve_send(obj_id, transport, request))

        async def rdt__free(self: Any, obj_id: str) -> None:
            _produce.serve_free(obj_id)

        async def rdt__anchors(self: Any, n: int) -> tuple[None, ...]:
            return (None,) * n  # its returns are this actor's anchors (_object._Anchors)

        async def rdt__ping(self: Any) -> str:
            return _object._token_for(os.getpid())  # a failed fetch asks whether the producer is alive

        async def rdt__group(self: Any, msg: Message) -> Any:
            # Group operations block for a whole collective: their own threads, so
            # that they never starve the copies of the shared pool.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(_io.pool(_io.GROUP), collective.serve, msg)

        async def rdt__publication(
            self: Any, name: str, after: int, wait_s: float, chunked: bool = False, incarnation: str | None = None
        ) -> Any:
            from . import _publish

            return await _publish.serve_poll(name, after, wait_s, chunked, incarnation)

    else:

        def rdt__send(self: Any, obj_id: str, transport: str, request: Any) -> Any:  # type: ignore[misc]
            return _io.start(_produce.serve_send(obj_id, transport, request)).result()

        def rdt__free(self: Any, obj_id: str) -> None:  # type: ignore[misc]
            _produce.serve_free(obj_id)

        def rdt__anchors(self: Any, n: int) -> tuple[None, ...]:  # type: ignore[misc]
            return (None,) * n

        def rdt__ping(self: Any) -> str:  # type: ignore[misc]
            return _object._token_for(os.getpid())  # (a restarted actor answers with another)

        def rdt__group(self: Any, msg: Message) -> Any:  # type: ignore[misc]
            return collective.serve(msg)

    publish = {"rdt__publication": ray.method(concurrency_group=PUBLISH_GROUP)(rdt__publication)} if is_async else {}
    return {
        **publish,
        "rdt__send": group(rdt__send),
        "rdt__free": group(rdt__free),
        "rdt__group": group(rdt__group),
        "rdt__anchors": group(rdt__anchors),
        "rdt__ping": group(rdt__ping),
    }
