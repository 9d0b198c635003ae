"""Transports by name: the built-in ones, loaded lazily, and registered ones."""

from __future__ import annotations

import importlib
import threading
from typing import Any

from .._errors import TransportUnavailableError
from ._base import Transport

# name -> "module:Class", imported on first use so that optional backends stay unloaded.
BUILTIN: dict[str, str] = {
    "shm": "rdt_async.transports.shm:ShmTransport",
    "object_store": "rdt_async.transports.object_store:ObjectStoreTransport",
}
AUTO = "auto"

_lock = threading.Lock()
_classes: dict[str, type[Transport[Any]]] = {}
_instances: dict[str, Transport[Any]] = {}


def names() -> list[str]:
    """Return every transport name a method may ask for, `auto` first."""
    return [AUTO, *BUILTIN, *(n for n in _classes if n not in BUILTIN)]


def check_name(name: str) -> str:
    """Return `name` if some transport has it, else raise naming the available ones."""
    if not isinstance(name, str) or name not in names():
        raise ValueError(
            f"unknown tensor_transport {name!r}; available: {', '.join(names())} "
            "(add your own with rdt.register_transport)"
        )
    return name


def transport_class(name: str) -> type[Transport[Any]]:
    cls = _classes.get(name)
    if cls is None:
        if name not in BUILTIN:
            check_name(name)
            raise TransportUnavailableError(f"transport {name!r} is not known in this process")
        module, _, attr = BUILTIN[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
        _classes[name] = cls
    return cls


def get(name: str) -> Transport[Any]:
    """Return this process's instance of a transport, creating it on first use.

    Raises: TransportUnavailableError naming why (a missing extra, no device).
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
            inst = _instances[name] = cls()
        return inst


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
