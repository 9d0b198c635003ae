"""One UCX per process: `nixl` and `ucxx` each bring their own UCX build, which clash.

NIXL's wheels bundle UCX 1.23 (renamed libraries), UCXX's use the libucx wheel (1.21).
Both builds install UCM memory hooks; with UCXX's loaded, a NIXL transfer handle
released mid-read crashed the process here (segfault in `check_xfer_state`). So the
first of the two that loads its UCX in a process owns it, and the other says so
(`TransportUnavailableError`, and in `available_transports()`) instead of crashing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from .._errors import TransportUnavailableError

_OTHER = {"nixl": "ucxx", "ucxx": "nixl"}
_lock = threading.Lock()
_owner: tuple[int, str] | None = None  # (pid, transport)


def conflict(name: str) -> str | None:
    """Return why `name` cannot load its UCX in this process, or None."""
    other = _OTHER[name]
    owner = _owner[1] if _owner is not None and _owner[0] == os.getpid() else None
    if owner == other or (name == "nixl" and "ucxx._lib.libucxx" in sys.modules):
        return (
            f"{other} already loaded its own UCX build in this process, and NIXL's and UCXX's "
            f"UCX builds clash; use one of nixl and ucxx per process (fetch {name} objects in "
            "another actor or process)"
        )
    return None


def claim(name: str) -> None:
    """Record that `name` loads its UCX here; raise if the other one already did."""
    global _owner
    with _lock:
        reason = conflict(name)
        if reason is not None:
            raise TransportUnavailableError(f"transport {name!r} is unavailable: {reason}")
        _owner = (os.getpid(), name)


def open_libraries(paths: list[str]) -> None:
    """dlopen each of `paths` (RTLD_LOCAL|RTLD_NOW, as ctypes' CDLL does) without the GIL.

    `libucs`'s constructors take ~0.4 s here (they load and probe UCX's modules). Opened by
    `ctypes.CDLL`, as the wheels' loaders do, that time holds the GIL: every other thread
    of the process, its actor's event loop too, stands still. Called through libc, a
    foreign function, it does not; the loaders' own dlopen then finds the library open.
    A library that does not open is left to them (they say why).
    """
    libc = ctypes.CDLL(None)
    dlopen = libc.dlopen
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    for path in paths:
        if os.path.isfile(path):
            dlopen(os.fsencode(path), os.RTLD_LOCAL | os.RTLD_NOW)  # (never closed: the loaders keep it)
