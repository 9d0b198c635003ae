"""Transports by name: the built-in ones, registered ones, and installed packages' ones.

A name is looked up, in order, among this process's registrations and the built-ins;
then through the cluster resolver, a hook the Ray layer installs (transports that
`rdt.register_transport` published from another process); then among the
`rdt_async.transports` entry points of installed packages. Nothing is imported or
scanned before a name misses. This module never imports Ray.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._errors import TransportUnavailableError
from ._base import NO_STORE, Keeper, Transport

# name -> "module:Class", imported on first use so that optional backends stay unloaded.
BUILTIN: dict[str, str] = {
    "inline": "rdt_async.transports.inline:InlineTransport",
    "shm": "rdt_async.transports.shm:ShmTransport",
    "object_store": "rdt_async.transports.object_store:ObjectStoreTransport",
    "nixl": "rdt_async.transports.nixl:NixlTransport",
    "cuda_ipc": "rdt_async.transports.cuda_ipc:CudaIpcTransport",
    "ucxx": "rdt_async.transports.ucxx:UcxxTransport",
    "tcp": "rdt_async.transports.tcp:TcpTransport",
    "gloo": "rdt_async.transports.gloo:GlooTransport",
    "nccl": "rdt_async.transports.gloo:NcclTransport",
}
AUTO = "auto"
# The path that always works, where a chosen one cannot reach the consumer (Ray's object store).
FALLBACK = "object_store"
# Names no registration may take: the built-ins, shipped or planned (compared case-blind).
RESERVED = frozenset({AUTO, "inline", "shm", "object_store", "nixl", "cuda_ipc", "ucxx", "tcp", "gloo", "nccl"})
ENTRY_POINT_GROUP = "rdt_async.transports"
_RAY_MANAGER_MODULE = "ray.experimental.rdt.tensor_transport_manager"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
# Parts of Ray's TensorTransportManager that the adapter never calls: not required.
_RAY_UNUSED = frozenset({"tensor_transport_backend", "actor_has_tensor_transport"})

T = TypeVar("T")
_log = logging.getLogger("rdt_async")


@dataclass(frozen=True)
class Registration:
    """A transport added by name: the class as given, its devices, where it came from."""

    name: str
    devices: tuple[str, ...]
    cls: type  # an rdt_async Transport subclass or a Ray TensorTransportManager subclass
    origin: str  # "register_transport", "cluster" or "entry point <module:attr>"


Resolver = Callable[[str], "tuple[Sequence[str], type] | None"]
Publisher = Callable[[Registration], None]
Lister = Callable[[], Sequence[str]]

_lock = threading.RLock()  # reentrant: loading a transport may register one
_classes: dict[str, type[Transport[Any]]] = {}
_instances: dict[str, Transport[Any]] = {}
_registrations: dict[str, Registration] = {}
_resolver: Resolver | None = None
_publisher: Publisher | None = None
_lister: Lister | None = None
_generation = 0  # see generation()
_known: list[type[Transport[Any]]] | None = None  # known_classes(), until the classes change
_listed_at: float | None = None  # when `_list_cluster` last listed the cluster's registrations
LIST_AGAIN_S = 1.0
_store: Keeper = NO_STORE


def hand_store(store: Keeper) -> None:
    """Hand every transport this process creates the producer's store (the core does, at import)."""
    global _store
    with _lock:
        _store = store
        for inst in _instances.values():
            inst.store = store


def set_cluster_hooks(*, resolve: Resolver, publish: Publisher, listing: Lister | None = None) -> None:
    """Install how registrations reach other processes (the Ray layer does, at import).

    `publish(registration)` runs for each `register_transport` in this process and may
    raise to refuse it; `resolve(name)` returns `(devices, cls)` registered elsewhere, or
    None; `listing()` the names registered anywhere so far whose class `auto_prepares`.
    """
    global _resolver, _publisher, _lister
    _resolver, _publisher, _lister = resolve, publish, listing


def register(
    name: str, devices: Sequence[str], cls: type, *, origin: str = "register_transport"
) -> Registration:
    """Add a transport class under `name`, for tensors on `devices`.

    Raises: TypeError for a non-class, a class of the wrong kind or one missing
    required methods (named); ValueError for a bad or built-in name, for devices that
    are not torch device types or that the class does not declare, or for a name
    already registered to another class.
    """
    reg = _validate(name, devices, cls, origin)
    effective = _effective_class(reg)
    with _lock:
        old = _registrations.get(name)
        if old is not None and old.cls is cls and old.devices == reg.devices:
            return old
        if old is not None and _qualname(old.cls) != _qualname(cls):
            raise ValueError(
                f"transport {name!r} is already registered to {_qualname(old.cls)} ({old.origin}); "
                f"register {_qualname(cls)} under another name"
            )
        # New, or a re-definition of the same class (a re-run cell, a reloaded module).
        old_class, old_instance = _classes.get(name), _instances.pop(name, None)
        _registrations[name], _classes[name] = reg, effective
        _changed()
        if origin == "register_transport" and _publisher is not None:
            try:
                _publisher(reg)
            except BaseException:
                _restore(name, old, old_class, old_instance)
                raise
    return reg


def _restore(
    name: str, reg: Registration | None, cls: type[Transport[Any]] | None, inst: Transport[Any] | None
) -> None:
    _put(_registrations, name, reg)
    _put(_classes, name, cls)
    _changed()
    _put(_instances, name, inst)


def _put(table: dict[str, T], name: str, value: T | None) -> None:
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value


def names() -> list[str]:
    """Return every transport name a method may ask for, `auto` first.

    Lists entry points of installed packages without importing them; transports
    registered in other processes appear once looked up here.
    """
    with _lock:
        local = [n for n in _classes if n not in BUILTIN]
    return [AUTO, *BUILTIN, *local, *(n for n in _entry_points() if n not in local)]


def loaded(name: object) -> bool:
    """Whether `name` is `auto`, a built-in transport's or one this process has loaded
    (registered, or looked up): looks nothing up."""
    return isinstance(name, str) and (name == AUTO or name in BUILTIN or name in _classes)


def generation() -> int:
    """A number that changes whenever the classes this process knows change (for caches)."""
    return _generation


def _changed() -> None:
    global _generation, _known
    _generation += 1
    _known = None


def known_classes() -> list[type[Transport[Any]]]:
    """The built-in transports' classes (importing their modules: ~60 ms, once), then the
    ones registered in this process or looked up here, and those registered anywhere in the
    cluster with `auto_prepares`, by the first call that found the cluster up (one listing,
    then each such class loaded). Imports no native library.

    What cannot load here is left out (said once, at debug level): a process that cannot
    use a transport never prepares objects for it.
    """
    global _known
    _list_cluster(again_after_s=None)
    known = _known
    if known is None:
        with _lock:
            local = [n for n in _classes if n not in BUILTIN]
        known = [c for c in (_lookup(n) for n in (*BUILTIN, *local)) if c is not None]
        _known = known if builtins_loaded() else None
    return list(known)


def _list_cluster(again_after_s: float | None) -> None:
    """Load the cluster's registrations that `auto` may prepare for: once, and again where
    `again_after_s` have passed since (a name in an object's metadata this process does
    not know may have been registered since: one listing a while, not a lookup a name)."""
    global _listed_at
    if _lister is None or (_listed_at is not None and (again_after_s is None or time.monotonic() - _listed_at < again_after_s)):
        return
    try:
        names = list(_lister())
    except Exception:  # (the cluster going down): the next call asks again
        return
    if names or _cluster_up():
        _listed_at = time.monotonic()
    for name in names:
        try:
            _lookup(name)
        except Exception as exc:
            _log.debug("rdt_async: transport %r is registered in the cluster but not loaded here: %s", name, exc)


def _cluster_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def builtins_loaded() -> bool:
    """Whether every built-in transport's module is imported (`known_classes` would not import)."""
    return all(n in _classes for n in BUILTIN)


def check_name(name: str) -> str:
    """Return `name` if some transport has it, else raise naming the available ones.

    Raises: ValueError; TransportUnavailableError if the name is known but its class
    cannot be loaded here.
    """
    if isinstance(name, str) and (name == AUTO or name in BUILTIN or _lookup(name) is not None):
        return name
    near = [n for n in names() if isinstance(name, str) and n.lower() == name.lower()]  # names are case-sensitive
    raise ValueError(
        f"unknown tensor_transport {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
        + f"; available: {', '.join(names())} (add your own with rdt.register_transport)"
    )


def transport_class(name: str) -> type[Transport[Any]]:
    """Return the Transport class registered under `name`, loading it on first use.

    Raises: TransportUnavailableError for an unknown name or a class that cannot load.
    """
    cls = _lookup(name)
    if cls is None:
        raise TransportUnavailableError(
            f"unknown transport {name!r} in this process; available: {', '.join(names())}. "
            "Register it with rdt.register_transport (in the driver, after ray.init(), it "
            "reaches every process of the cluster) or install the package that provides it"
        )
    return cls


def transport(name: str) -> Transport[Any]:
    """Return this process's instance of a transport, creating it on first use.

    Raises: TransportUnavailableError naming why (a missing extra, no device, unknown).
    """
    inst = _instances.get(name)
    if inst is not None:
        return inst
    with _lock:
        inst = _instances.get(name)
        if inst is None:
            cls = transport_class(name)
            reason = cls.unavailable_reason()
            if reason is not None:
                raise TransportUnavailableError(f"transport {name!r} is unavailable: {reason}")
            try:
                inst = cls()
            except Exception as exc:
                raise TransportUnavailableError(
                    f"transport {name!r} could not be created: {type(exc).__name__}: {exc}"
                ) from exc
            inst.store = _store
            _instances[name] = inst
        return inst


def created() -> list[Transport[Any]]:
    """Return the transports this process has created so far (creating none)."""
    with _lock:
        return list(_instances.values())


def available() -> dict[str, bool | str]:
    """Return name -> True, or the reason the transport cannot be used here."""
    out: dict[str, bool | str] = {AUTO: True}
    for name in names()[1:]:
        try:
            reason = transport_class(name).unavailable_reason()
        except Exception as exc:  # a broken optional install is a reason, not a crash
            reason = f"{type(exc).__name__}: {exc}"
        out[name] = True if reason is None else reason
    return out


# -- lookup: this process, the built-ins, the cluster, installed packages -----------------


def known_class(name: str) -> type[Transport[Any]] | None:
    """The class of a built-in transport, or of one registered in this process, else None.

    Scans no package and looks up no name elsewhere: for names that came from another
    process (an object's metadata), which only transports this process knows may answer
    for. Those it knows include the cluster's registrations that `auto` may prepare
    objects for (listed once per process, see `known_classes`).
    """
    if not isinstance(name, str):
        return None
    if name not in _classes and _could_be_registered(name):
        _list_cluster(again_after_s=LIST_AGAIN_S)  # registered since this process last listed?
    if name in _classes or name in BUILTIN:
        return _lookup(name)
    return None


def _lookup(name: str) -> type[Transport[Any]] | None:
    cls = _classes.get(name)
    if cls is not None or not isinstance(name, str):
        return cls
    with _lock:
        cls = _classes.get(name)
        if cls is None and name in BUILTIN:
            module, _, attr = BUILTIN[name].partition(":")
            cls = _classes[name] = getattr(importlib.import_module(module), attr)
            _changed()
        if cls is None and not _is_reserved(name):
            reg = _from_cluster(name) or _from_entry_point(name)
            cls = _classes.get(name) if reg is not None else None
        return cls


def _from_cluster(name: str) -> Registration | None:
    if _resolver is None:
        return None
    try:
        found = _resolver(name)
        if found is None:
            return None
        devices, cls = found
        return register(name, devices, cls, origin="cluster")
    except Exception as exc:
        raise TransportUnavailableError(
            f"transport {name!r} is registered in this Ray cluster but cannot be loaded in this "
            f"process: {type(exc).__name__}: {exc}"
        ) from exc


def _from_entry_point(name: str) -> Registration | None:
    ep = _entry_points().get(name)
    if ep is None:
        return None
    where = f"entry point {ep.value!r} of {_dist_name(ep)}"
    try:
        cls = ep.load()
        devices = getattr(cls, "devices", None)
        if devices is None:
            raise TypeError(f"{_qualname(cls)} declares no `devices` (e.g. devices = ('cpu',))")
        return register(name, devices, cls, origin=f"entry point {ep.value}")
    except Exception as exc:
        raise TransportUnavailableError(
            f"transport {name!r} ({where}) cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the `rdt_async.transports` group, first of each name (not loaded)."""
    out: dict[str, importlib.metadata.EntryPoint] = {}
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution must not break lookups of the others
        return out
    for ep in found:
        if not _is_reserved(ep.name) and _NAME.fullmatch(ep.name):
            out.setdefault(ep.name, ep)
    return out


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"package {dist.name}" if dist is not None else "an installed package"


# -- validation --------------------------------------------------------------------------


def _could_be_registered(name: str) -> bool:
    """Whether some process may have registered `name` (not "auto", a built-in's or a
    malformed one: a producing call asks for "auto" each time, a ref may carry anything)."""
    return _lister is not None and _NAME.fullmatch(name) is not None and not _is_reserved(name)


def _is_reserved(name: str) -> bool:
    return name.lower() in RESERVED or name.lower() in {n.lower() for n in BUILTIN}


def _validate(name: str, devices: Sequence[str], cls: type, origin: str) -> Registration:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a transport name is 1-64 letters, digits, '_', '-' or '.', not {name!r}"
        )
    if _is_reserved(name):
        raise ValueError(
            f"{name!r} is the name of a built-in transport; register yours under another "
            f"name, such as 'my_{name.lower()}'"
        )
    if not isinstance(cls, type):
        hint = " (pass the class itself, not an instance)" if _is_transport_class(type(cls)) else ""
        raise TypeError(
            f"register_transport takes a transport class, not {type(cls).__name__} {cls!r}{hint}"
        )
    if issubclass(cls, Transport):
        problems = _transport_problems(cls)
    elif _is_ray_manager(cls):
        problems = _ray_manager_problems(cls)
    else:
        raise TypeError(
            f"{_qualname(cls)} is neither an rdt_async.Transport subclass nor a subclass of "
            "Ray's ray.experimental.rdt.TensorTransportManager"
        )
    if problems:
        raise TypeError(f"transport class {_qualname(cls)} cannot be registered: {'; '.join(problems)}")
    return Registration(name, _check_devices(devices, cls), cls, origin)


def _is_transport_class(cls: type) -> bool:
    return issubclass(cls, Transport) or _is_ray_manager(cls)


def _is_ray_manager(cls: type) -> bool:
    # A subclass of Ray's class means Ray is imported already: never import it here.
    module = sys.modules.get(_RAY_MANAGER_MODULE)
    return module is not None and issubclass(cls, module.TensorTransportManager)


def _defined_by(cls: type, attr: str) -> type | None:
    return next((k for k in cls.__mro__ if attr in vars(k)), None)


# What a subclass must write, for each abstract method of Transport, as the error shows it.
_SIGNATURES = {"receive": "async def receive(self, info, buffers, channel) -> list[Tensor]"}
_ASYNC = ("receive", "send_multiple_tensors", "refuse")  # awaited on the I/O loop
_SYNC = ("prepare", "garbage_collect", "recycle", "lends_memory", "check_tensors", "receive_nowait", "warm_up")


def _transport_problems(cls: type[Transport[Any]]) -> list[str]:
    problems = []
    missing = [_SIGNATURES.get(m, m) for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    if not cls.one_sided and _defined_by(cls, "send_multiple_tensors") is Transport:
        missing.append(
            "async def send_multiple_tensors(self, obj_id, tensors, meta, request) "
            "(it says one_sided = False)"
        )
    if missing:
        problems.append(f"it is missing {' and '.join(missing)}")
    for attr in _ASYNC:
        fn = getattr(cls, attr, None)
        if attr not in cls.__abstractmethods__ and not inspect.iscoroutinefunction(fn):
            problems.append(f"{attr} must be `async def` (it runs on rdt_async's I/O loop)")
    for attr in _SYNC:
        if inspect.iscoroutinefunction(getattr(cls, attr, None)):
            problems.append(f"{attr} must be a plain `def` (rdt_async calls it without awaiting)")
    return problems


def _ray_manager_problems(cls: type) -> list[str]:
    abstract = set(getattr(cls, "__abstractmethods__", ()))
    unused = set(_RAY_UNUSED)
    try:
        if "is_one_sided" not in abstract and cls.is_one_sided():  # type: ignore[attr-defined]
            unused.add("send_multiple_tensors")  # Ray's docs let one-sided managers omit it
        if "can_abort_transport" not in abstract and not cls.can_abort_transport():  # type: ignore[attr-defined]
            unused.add("abort_transport")
    except Exception as exc:
        return [f"its capability query raised {type(exc).__name__}: {exc}"]
    missing = sorted(abstract - unused)
    return [f"it is missing {', '.join(missing)} (abstract in TensorTransportManager)"] if missing else []


def _check_devices(devices: Sequence[str], cls: type) -> tuple[str, ...]:
    if isinstance(devices, (str, bytes)):
        raise TypeError(f"devices is a list of device types such as ['cpu'], not the string {devices!r}")
    try:
        devs = tuple(dict.fromkeys(devices))
    except TypeError:
        raise TypeError(f"devices is a list of device types such as ['cpu'], not {devices!r}") from None
    if not devs:
        raise ValueError("devices must name at least one device type the transport moves, such as ['cpu']")
    for d in devs:
        if not isinstance(d, str):
            raise TypeError(f"devices holds device type names (str), not {d!r}")
        try:
            dev = torch.device(d)
        except (RuntimeError, ValueError) as exc:
            hint = " (did you mean 'cuda'?)" if d.lower() == "gpu" else ""
            raise ValueError(f"{d!r} is not a torch device type{hint}: {exc}") from None
        if dev.type != d:
            raise ValueError(f"devices holds device types such as {dev.type!r}, not the device {d!r}")
    declared = _declared_devices(cls)
    if declared is not None:
        cannot = [d for d in devs if d not in declared]
        if cannot:
            raise ValueError(
                f"{_qualname(cls)} declares devices = {tuple(declared)!r} and cannot handle "
                f"{', '.join(cannot)}; register it for a subset of {list(declared)}"
            )
    return devs


def _declared_devices(cls: type) -> tuple[str, ...] | None:
    owner = _defined_by(cls, "devices")
    if owner is None or owner is Transport:
        return None
    declared = vars(owner)["devices"]
    return (declared,) if isinstance(declared, str) else tuple(declared)


def _effective_class(reg: Registration) -> type[Transport[Any]]:
    """The class the registry instantiates: the name and devices are the registration's."""
    if issubclass(reg.cls, Transport):
        namespace = {
            "name": reg.name,
            "devices": reg.devices,
            "__module__": reg.cls.__module__,
            "__qualname__": reg.cls.__qualname__,
            "__doc__": reg.cls.__doc__,
        }
        meta: Any = type(reg.cls)  # the class's own metaclass (ABCMeta, or the user's)
        made: type[Transport[Any]] = meta(reg.cls.__name__, (reg.cls,), namespace)
        return made
    from ._ray_adapter import adapt

    return adapt(reg.name, reg.devices, reg.cls)


def _qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
