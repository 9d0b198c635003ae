"""Where rdt_async's listeners bind, the address they advertise, and the ports they may take.

Ray-free: the core hands in the address Ray knows this node by (`set_node_ip`, at a
process's first produce), which is the address other nodes reach this one at. On a
cluster whose node IPs sit on a data network (a second NIC, IPoIB, a container or VPN
network) that is not the default route, the address of the route out is the wrong one:
from another host it may be unreachable, or reached over a slower network.

The address a listener of transport X advertises, first found of:

    RDT_X_HOST            (one transport: RDT_TCP_HOST, RDT_UCXX_HOST)
    RDT_ADVERTISE_HOST    (every transport)
    Ray's node IP         (handed in by the core)
    the route out         (outside Ray: the source address of the default route, IPv4's,
                          else IPv6's)

and it binds that address (every interface where it is the route out's, which is only
a guess, or where the address is not one of this host's: behind NAT). Each must be an IP
literal (an IPv6 scope, `%eth0`, naming an interface of this host): metadata carries no
names, so a consumer never resolves one. `RDT_PORT_RANGE`
(`LOW-HIGH`) confines every port rdt_async listens on to that range.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import random
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .._errors import TransportUnavailableError

ADVERTISE_ENV = "RDT_ADVERTISE_HOST"
PORT_RANGE_ENV = "RDT_PORT_RANGE"
NODE_IP = "Ray's node IP"
ROUTE_OUT = "the address of the route out"

log = logging.getLogger("rdt_async")
T = TypeVar("T")

_node_ip: str | None = None
_node_ips: Callable[[], list[str]] = list  # the cluster's nodes' addresses, asked only where needed


def set_node_ip(ip: str | None, node_ips: Callable[[], list[str]] = list) -> None:
    """Hand in the address Ray knows this node by (None: not in a Ray session), and how to
    ask the addresses of the cluster's nodes (`cluster_interfaces`).

    Runs on: either side, by the core (`_ray`), before a listener is opened.
    """
    global _node_ip, _node_ips
    _node_ip = None if ip is None else ip_literal(ip, "Ray's node IP address")
    _node_ips = node_ips


def ip_literal(host: str, what: str) -> str:
    """Return `host` (spaces around it dropped) as a canonical IP literal that a peer can
    connect to; no name is ever resolved.

    Raises: ValueError naming `what` (the setting or field it came from).
    """
    raw = host.strip()
    if not is_ip(raw):
        raise ValueError(f"{what}={host!r}: give an IP address (such as 10.0.0.5 or fd00::5), {_not_ip(raw)}")
    scope = getattr(ipaddress.ip_address(raw), "scope_id", None)
    if scope is not None and not _is_interface(scope):
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise ValueError(
            f"{what}={host!r}: its scope {scope!r} names no network interface of this host ({names}); "
            "give the interface the address is on (such as fe80::1%eth0), or an address without a scope"
        )
    why = not_a_peer(raw)
    if why is not None:
        raise ValueError(
            f"{what}={host!r}: that is {why}, which a peer on another node cannot connect to; give an address "
            "of this host that the other nodes reach (such as 10.0.0.5 or fd00::5)"
        )
    return str(ipaddress.ip_address(raw))


def _not_ip(raw: str) -> str:
    """What is wrong with `raw`, which is no IP address: the parser's reason where it is
    written as one (digits and dots, or colons), else that it is a name."""
    if ":" in raw or re.fullmatch(r"[0-9.]+", raw):
        version, parse = (6, ipaddress.IPv6Address) if ":" in raw else (4, ipaddress.IPv4Address)
        try:
            parse(raw)
        except ValueError as exc:
            return f"not a malformed one (as IPv{version}: {exc})"
    return "not a name"


def _is_interface(scope: str) -> bool:
    """Whether an IPv6 scope (`%eth0`, `%2`) names one of this host's network interfaces."""
    return any(scope in (name, str(index)) for index, name in socket.if_nameindex())


def not_a_peer(host: str) -> str | None:
    """Why IP literal `host` names no listener a peer could connect to, or None: the
    unspecified address (0.0.0.0, ::: every interface, or a peer's own host), a multicast
    address, the broadcast address (an IPv4-mapped one alike)."""
    ip = ipaddress.ip_address(host_key(host) or host)
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address"
    return None


def is_ip(host: object) -> bool:
    """Whether `host` is a string holding an IP address (v4 or v6, no brackets)."""
    if not isinstance(host, str):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_key(host: object) -> str | None:
    """`host` canonical, an IPv4-mapped IPv6 address as its IPv4 one: each host has one
    spelling. None where it is no IP address (a ref's field: never raises)."""
    if not is_ip(host):
        return None
    ip = ipaddress.ip_address(host)  # type: ignore[arg-type]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


@dataclass(frozen=True)
class Address:
    """Where a transport's listener binds and what it advertises, and which setting said so."""

    host: str  # advertised: an IP literal
    bind: str  # "" for every interface
    source: str  # the setting (or NODE_IP, ROUTE_OUT) that gave `host`

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET


def address(env: str) -> Address:
    """Where a listener of the transport whose own setting is `env` binds, and what it advertises.

    Raises: ValueError naming the setting whose value is not an IP address a peer can
    connect to.
    """
    for name in (env, ADVERTISE_ENV):
        raw = os.environ.get(name, "")
        if raw.strip():  # (spaces alone: unset, as for RDT_PORT_RANGE)
            host = ip_literal(raw, name)
            return Address(host, host, name)
    if _node_ip is not None:
        return Address(_node_ip, _node_ip, NODE_IP)
    return Address(route_out(), "", ROUTE_OUT)


def route_out() -> str:
    """The source address of this host's default route: IPv4's, else IPv6's (on a host
    with no IPv4 network), else loopback."""
    return _source_toward("10.255.255.255") or _source_toward("2001:db8::1") or "127.0.0.1"


def settings_hint(env: str) -> str:
    """What a user sets to change the address transport `env` advertises."""
    return f"set {env} (this transport) or {ADVERTISE_ENV} (every transport) to an address of this host the peer can reach"


def port_range() -> tuple[int, int] | None:
    """The range `RDT_PORT_RANGE` confines listeners to, or None (the kernel picks).

    Raises: ValueError naming the setting when it is not `LOW-HIGH` within 1..65535.
    """
    raw = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    low, _, high = raw.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={raw!r}: give LOW-HIGH, two ports in 1..65535 (e.g. 20000-20100)")
    return lo, hi


def ports() -> Iterator[int]:
    """Ports to try for one listener: 0 (the kernel picks), or each port of the range once
    from a random one (processes starting together then rarely try the same port)."""
    span = port_range()
    if span is None:
        yield 0
        return
    lo, hi = span
    n = hi - lo + 1
    first = random.randrange(n)
    for i in range(n):
        yield lo + (first + i) % n


def in_range(open_port: Callable[[int], T], taken: Callable[[BaseException], bool], what: str) -> T:
    """Return `open_port(port)` for the first port of `ports()` it does not find `taken`.

    Raises: TransportUnavailableError naming RDT_PORT_RANGE when every port of the range is taken.
    """
    for port in ports():
        try:
            return open_port(port)
        except Exception as exc:
            if port == 0 or not taken(exc):
                raise
    raise TransportUnavailableError(
        f"{what} cannot listen: every port of {PORT_RANGE_ENV}={os.environ.get(PORT_RANGE_ENV)} is taken; "
        f"widen {PORT_RANGE_ENV} (each producing process that listens takes one port per transport), or unset it"
    )


def _in_use(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES)


def tcp_listener(env: str, what: str, backlog: int = 128) -> tuple[socket.socket, Address]:
    """A listening TCP socket where `address(env)` says, on a port `ports()` allows.

    Runs on: producer. Raises: TransportUnavailableError (no free port in the range, or
    the address cannot be listened on), ValueError (a setting that is not an address).
    """
    where = address(env)
    bind = where.bind

    def open_port(port: int) -> socket.socket:
        nonlocal bind
        try:
            return socket.create_server((bind, port), family=where.family, backlog=backlog)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL or not bind:
                raise
            # Not an address of this host (NAT in front of it): every interface, then.
            log.warning("rdt_async: %s is not an address of this host (%s); %s listens on every interface", bind, where.source, what)
            bind = ""
            return socket.create_server((bind, port), family=where.family, backlog=backlog)

    try:
        return in_range(open_port, _in_use, what), where
    except OSError as exc:
        raise TransportUnavailableError(
            f"{what} cannot listen on {where.host or 'every interface'} ({where.source}): {exc}; {settings_hint(env)}"
        ) from exc


def interface_of(host: str) -> str | None:
    """The name of this host's network interface that holds address `host`, or None
    (not an address of this host: behind NAT; not Linux)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    try:
        if ip.version == 6:
            return _v6_interface(ip)
        return _v4_interfaces().get(str(ip))
    except OSError:
        return None


def _v4_interfaces() -> dict[str, str]:
    """This host's IPv4 addresses and the interface of each (SIOCGIFCONF: every address,
    aliases too; an alias's label `eth0:1` names its interface `eth0`)."""
    import array
    import fcntl
    import struct

    if struct.calcsize("P") != 8:
        return {}
    siocgifconf, ifreq = 0x8912, 40  # struct ifreq on 64-bit Linux: 16 bytes of name, 24 of union
    size = 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while True:
            buf = array.array("B", bytes(size * ifreq))
            filled = struct.unpack("iL", fcntl.ioctl(s.fileno(), siocgifconf, struct.pack("iL", len(buf), buf.buffer_info()[0])))[0]
            if filled < len(buf):
                break
            size *= 2  # it may have left some out
    raw = buf.tobytes()
    found: dict[str, str] = {}
    for at in range(0, filled, ifreq):
        name = raw[at : at + 16].split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
        found.setdefault(socket.inet_ntoa(raw[at + 20 : at + 24]), name)  # sockaddr_in's address
    return found


def _v6_interface(ip: ipaddress.IPv6Address) -> str | None:
    with open("/proc/net/if_inet6") as f:  # address (32 hex digits), index, prefix, scope, flags, name
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[0] == ip.exploded.replace(":", ""):
                return fields[5]
    return None


def cluster_interfaces(host: str) -> list[str]:
    """This host's interfaces that hold `host` (first) or that its routes take to the
    addresses of the cluster's nodes: where traffic of this cluster goes. Empty where
    `host` is none of this host's addresses (behind NAT)."""
    first = interface_of(host)
    if first is None:
        return []
    found = [first]
    try:
        peers = _node_ips()
    except Exception as exc:  # (Ray's GCS out of reach): the node's own interface still
        log.debug("rdt_async: could not ask the cluster's node addresses: %s", exc)
        peers = []
    for peer in peers:
        source = _source_toward(peer)
        name = interface_of(source) if source else None
        if name is not None and name not in found:
            found.append(name)
    return found


def _source_toward(peer: str) -> str | None:
    """The source address this host's routes give a packet to `peer`, or None where no
    route leads there (no packet is sent: connecting a UDP socket only picks a route)."""
    if not is_ip(peer):
        return None
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
        except OSError:
            return None
