"""One UCX per process: `nixl` and `ucxx` each bring their own UCX build, which clash.

NIXL's wheels bundle UCX 1.23 (renamed libraries), UCXX's use the libucx wheel (1.21).
Both builds install UCM memory hooks; with UCXX's loaded, a NIXL transfer handle
released mid-read crashed the process here (segfault in `check_xfer_state`). So the
first of the two that loads its UCX in a process owns it, and the other says so
(`TransportUnavailableError`, and in `available_transports()`) instead of crashing.

Either UCX, left to itself, uses every network interface of the host: its worker address
lists each, and a peer may open a lane to any of them (a management network behind a
firewall, a container bridge, a link that goes away). A context ucxx makes keeps its
network to the interfaces this cluster's traffic takes; NIXL's and ucxx's keep their
ports to RDT_PORT_RANGE (`settings`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Iterator

from .._errors import TransportUnavailableError
from . import _net

_OTHER = {"nixl": "ucxx", "ucxx": "nixl"}
# SYNs UCX's TCP connects resend before they give up: 1, 2, 4 and 8 s apart, so a connect
# no one answers (a firewall that drops the port) fails after ~15 s, where the kernel's
# default (6) waits ~127 s. A SYN a LAN lost is resent long before that.
SYN_CNT = 3
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


def settings(env: str, devices: bool = True) -> dict[str, str]:
    """UCX settings for a context made in this process, each only where the environment
    names none (yours win; `UCX_NET_DEVICES=all` gives UCX its default back):

    - `UCX_NET_DEVICES`: the interface holding the address this transport advertises
      (`_net.address(env)`: its own setting, RDT_ADVERTISE_HOST, or Ray's node IP), those
      this host's routes take to the cluster's other nodes (`_net.cluster_interfaces`),
      loopback (this host's own processes), and every active RDMA port (`mlx5_0:1`, ...):
      UCX's RDMA transports stay as they were. Outside Ray, or where the address is none
      of this host's, UCX keeps its default.
    - `UCX_TCP_BRIDGE_ENABLE=y` where one of them is a bridge (UCX leaves bridges out).
    - `UCX_TCP_PORT_RANGE` from RDT_PORT_RANGE, so that UCX's own listeners keep to it.
    - `UCX_TCP_SYN_CNT` and `UCX_TCP_CM_SYN_CNT` (UCX's lanes, ucxx's connect to a
      listener): SYN_CNT SYNs resent, so that UCX's connect into a port a firewall drops
      fails in ~15 s, not the kernel's ~127 s (`net.ipv4.tcp_syn_retries=6`).

    `devices=False`: the port range only (NIXL's agent: see `nixl/_agent.Agent`); the
    address is not read.
    Raises: TransportUnavailableError naming a setting that is not what it should be
    (RDT_PORT_RANGE; with `devices`, the address's: `env` or RDT_ADVERTISE_HOST): `auto`
    takes another path, a transport named explicitly fails saying which setting to mend.
    """
    out: dict[str, str] = {}
    found: list[str] = []
    try:
        span = _net.port_range()
        if devices and "UCX_NET_DEVICES" not in os.environ:
            where = _net.address(env)
            if where.source != _net.ROUTE_OUT:
                found = _net.cluster_interfaces(where.host)
    except ValueError as exc:  # (a path `auto` may leave out: it takes another)
        raise TransportUnavailableError(f"UCX cannot be set up here: {exc}") from exc
    if found:
        # Loopback too: UCX's control messages between processes of this host go over TCP
        # (NIXL asks for peer failure handling, which UCX's shared-memory transports lack),
        # and UCX takes a device only where the route to the peer leaves through it: to an
        # address of this host, that is `lo` (without it: "no route", the agent's endpoint
        # fails). UCX offers loopback to processes of this host only.
        names = [*found, *(["lo"] if "lo" not in found else [])]
        out["UCX_NET_DEVICES"] = ",".join([*names, *_rdma_ports()])
        if any(os.path.isdir(f"/sys/class/net/{d}/bridge") for d in found):
            out["UCX_TCP_BRIDGE_ENABLE"] = "y"
    if span is not None:
        out["UCX_TCP_PORT_RANGE"] = f"{span[0]}-{span[1]}"
    out["UCX_TCP_SYN_CNT"] = out["UCX_TCP_CM_SYN_CNT"] = str(SYN_CNT)
    return {k: v for k, v in out.items() if k not in os.environ}


def _rdma_ports() -> list[str]:
    """This host's active RDMA ports, as UCX names them (`mlx5_0:1`)."""
    root = "/sys/class/infiniband"
    found: list[str] = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return found
    for dev in devices:
        try:
            ports = sorted(os.listdir(f"{root}/{dev}/ports"), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            continue
        for port in ports:
            try:
                with open(f"{root}/{dev}/ports/{port}/state") as f:
                    active = "ACTIVE" in f.read()
            except OSError:
                active = False
            if active:
                found.append(f"{dev}:{port}")
    return found


@contextlib.contextmanager
def environment(added: dict[str, str]) -> Iterator[None]:
    """Set `added` in the environment while a UCX context is made (UCX reads it then), and
    take it away after: a process's children and later contexts do not inherit it."""
    if added:
        logging.getLogger("rdt_async").debug("rdt_async: making a UCX context with %s", added)
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
