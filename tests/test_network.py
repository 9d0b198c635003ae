"""Any cluster, not only ours: what listeners advertise and bind, the ports they take, what a
consumer accepts from a ref's address, and `auto` falling back where its path cannot reach.

The cross-host tests run on the topology RDT_TEST_TOPOLOGY names (conftest.py); on `split`
(the default) Ray's node IPs are on a data network that is no host's default route.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import socket

import pytest
import ray
import torch
from conftest import ON_NODE2
from helpers import Said
from probes import listening

import rdt_async as rdt
from rdt_async.transports import _net, tcp
from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo

UCXX = importlib.util.find_spec("ucxx") is not None
N = 16 << 20  # 64 MiB of float32


@rdt.remote
class Producer:
    @rdt.method(tensor_transport="auto")
    def make(self, n: int, v: float):
        return {"w": torch.full((n,), v)}

    @rdt.method(tensor_transport="tcp")
    def make_tcp(self, n: int, v: float):
        return {"w": torch.full((n,), v)}

    @rdt.method(tensor_transport="ucxx")
    def make_ucxx(self, n: int, v: float):
        return {"w": torch.full((n,), v)}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def tcp_address(self) -> tuple[str, int]:
        meta = tcp._listening().meta
        return meta.host, meta.port

    def ucxx_address(self) -> tuple[str, int]:
        import os

        from rdt_async.transports import ucxx

        meta = ucxx._workers[os.getpid()].address
        return meta.host, meta.port


@rdt.remote
class Consumer:
    def __init__(self) -> None:
        self.said = Said()
        logging.getLogger("rdt_async").addHandler(self.said)

    async def read(self, refs) -> tuple[list[float], dict, list[dict], list[str]]:
        before = collections.Counter(rdt.store_stats()["fetches"])
        sums = [float((await rdt.fetch(r))["w"].sum()) for r in refs]
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        return sums, dict(used), rdt.store_stats()["auto"][-len(refs):], list(self.said.lines)

    async def read_error(self, refs, tensor_transport=None) -> str:
        try:
            await rdt.fetch(refs[0], tensor_transport=tensor_transport)
        except rdt.RDTError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"


def _split(cluster) -> None:
    if cluster.hosts is None or cluster.hosts.topology == "flat":
        pytest.skip("needs a split topology (RDT_TEST_TOPOLOGY=split, three or split6, network namespaces)")


# -- addresses ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actors(cluster):
    """A producer and a consumer on each host, shared by the module's tests."""
    made = {
        "head": Producer.remote(),
        "far": Producer.options(**ON_NODE2).remote(),
        "here_reader": Consumer.remote(),
        "far_reader": Consumer.options(**ON_NODE2).remote(),
    }
    yield made
    for actor in made.values():
        ray.kill(actor)


def test_auto_across_hosts_reads_64_mib_both_ways_over_tcp_at_rays_node_ips(ray_session, actors):
    """The bug of issue 29: on split, tcp advertised the head's default-route address, which
    the other host cannot reach (`OSError: [Errno 101] Network is unreachable`)."""
    head, far = actors["head"], actors["far"]
    here_reader, far_reader = actors["here_reader"], actors["far_reader"]
    sums, used, choices, _ = ray.get(far_reader.read.remote([head.make.remote(N, 1.0)]))
    assert sums == [float(N)] and used == {"tcp": 1}, choices
    sums, used, choices, _ = ray.get(here_reader.read.remote([far.make.remote(N, 2.0)]))
    assert sums == [2.0 * N] and used == {"tcp": 1}, choices
    for p in (head, far):
        host, port = ray.get(p.tcp_address.remote())
        assert host == ray.get(p.node_ip.remote()) and 0 < port < 65536


@pytest.mark.skipif(not UCXX, reason="ucxx is not installed")
def test_ucxx_advertises_rays_node_ip_and_reads_across_hosts(ray_session, actors):
    head, reader = actors["head"], actors["far_reader"]
    node_ip = ray.get(head.node_ip.remote())
    if ":" in node_ip:  # (split6) UCXX's listener is IPv4 only: the producer refuses, naming the fix
        error = ray.get(reader.read_error.remote([head.make_ucxx.remote(1 << 20, 3.0)]))
        assert error == (
            f"TransportUnavailableError: transport 'ucxx' cannot listen for {node_ip} (Ray's node IP): UCXX's "
            "listener binds IPv4 only (0.0.0.0); set RDT_UCXX_HOST to an IPv4 address of this host, or use tcp"
        )
        return
    sums, used, _, _ = ray.get(reader.read.remote([head.make_ucxx.remote(1 << 20, 3.0)]))
    assert sums == [3.0 * (1 << 20)] and used == {"ucxx": 1}
    host, _ = ray.get(head.ucxx_address.remote())
    assert host == ray.get(head.node_ip.remote())


NIXL = importlib.util.find_spec("nixl") is not None
UCX_RANGE = (31000, 31999)


@rdt.remote
class UcxProducer:
    """A producer whose UCX context is made after the test's changes to its host."""

    def __init__(self) -> None:
        self.before = listening()  # Ray's own

    @rdt.method
    def make(self, n: int, v: float):
        return {"w": torch.full((n,), v)}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def listening(self) -> list[tuple[str, int]]:
        """What listens since it was made: UCX's listeners (and ucxx's request listener)."""
        return sorted(listening() - self.before)


@pytest.mark.parametrize("transport", [
    pytest.param("ucxx", marks=pytest.mark.skipif(not UCXX, reason="ucxx is not installed")),
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="nixl is not installed")),
])
def test_ucx_keeps_to_the_interface_of_rays_node_ip_and_to_rdt_port_range(ray_session, actors, transport):
    """UCX left to itself listens on every interface of its host and lets a peer open lanes
    to any of them. On the flat topology a link of another host on the head (which the test
    adds here) ended every ucxx fetch from the other host in PeerDiedError ("the
    producer's endpoint closed"); behind a firewall, UCX's listeners took ports outside
    RDT_PORT_RANGE. Now ucxx's UCX listens only on Ray's node IP and loopback (and its
    request listener on 0.0.0.0), NIXL's and ucxx's on ports in RDT_PORT_RANGE, and the
    fetch reads the value."""
    from rdt_async.bench._hosts import Hosts

    if ray_session.hosts is None:
        pytest.skip("needs network namespaces")
    if transport == "ucxx" and ray_session.hosts.topology == "split6":
        pytest.skip("ucxx refuses IPv6 node IPs (test_ucxx_advertises_rays_node_ip_and_reads_across_hosts)")
    extra = Hosts(ray_session.hosts.topology)  # a link in the head's namespace, to a host with nobody on it
    try:
        confined = {"env_vars": {"RDT_PORT_RANGE": f"{UCX_RANGE[0]}-{UCX_RANGE[1]}"}}
        producer = UcxProducer.options(runtime_env=confined).remote()  # fresh: its UCX is made after the link
        # (ucxx: the module's reader on node2, whose UCX is ucxx's; nixl's needs a process of its own)
        reader = actors["far_reader"] if transport == "ucxx" else Consumer.options(**ON_NODE2).remote()
        ref = producer.make.options(tensor_transport=transport).remote(1 << 20, 5.0)
        sums, used, _, _ = ray.get(reader.read.remote([ref]), timeout=120)
        assert sums == [5.0 * (1 << 20)] and used == {transport: 1}
        node_ip, listening = ray.get([producer.node_ip.remote(), producer.listening.remote()])
        assert listening and all(UCX_RANGE[0] <= p <= UCX_RANGE[1] for _, p in listening), listening
        if transport == "ucxx":  # (NIXL's UCX keeps every interface: see nixl/_agent.Agent)
            ucx = [(h, p) for h, p in listening if h == node_ip]
            assert ucx and {h for h, _ in listening} <= {node_ip, "127.0.0.1", "0.0.0.0"}, (node_ip, listening)
        ray.kill(producer)
        if transport == "nixl":
            ray.kill(reader)
    finally:
        extra.close()


def test_settings_must_be_ip_addresses(monkeypatch):
    monkeypatch.setenv("RDT_ADVERTISE_HOST", "head.example")
    with pytest.raises(ValueError, match=r"RDT_ADVERTISE_HOST='head.example': give an IP address"):
        _net.address("RDT_TCP_HOST")
    # Addresses no peer connects to are refused, naming the setting (they were advertised).
    for host, what in (("0.0.0.0", "the unspecified address"), ("::", "the unspecified address"),
                       ("224.0.0.1", "a multicast address"), ("255.255.255.255", "the broadcast address")):
        monkeypatch.setenv("RDT_TCP_HOST", host)
        with pytest.raises(ValueError, match=rf"RDT_TCP_HOST='{_re(host)}': that is {what}, which a peer on another node cannot connect to; give an address of this host"):
            _net.address("RDT_TCP_HOST")
    monkeypatch.setenv("RDT_TCP_HOST", " 10.1.2.3 ")  # spaces around it are dropped, as RDT_PORT_RANGE's are
    assert _net.address("RDT_TCP_HOST") == _net.Address("10.1.2.3", "10.1.2.3", "RDT_TCP_HOST")
    monkeypatch.setenv("RDT_TCP_HOST", "  ")  # spaces alone: unset
    with pytest.raises(ValueError, match=r"RDT_ADVERTISE_HOST='head.example'"):
        _net.address("RDT_TCP_HOST")
    monkeypatch.setenv("RDT_TCP_HOST", "10.1.2.3")
    assert _net.address("RDT_TCP_HOST") == _net.Address("10.1.2.3", "10.1.2.3", "RDT_TCP_HOST")  # the transport's own wins
    monkeypatch.delenv("RDT_TCP_HOST")
    monkeypatch.setenv("RDT_ADVERTISE_HOST", "fd00::7")
    assert _net.address("RDT_UCXX_HOST").host == "fd00::7"


def test_a_malformed_address_setting_says_what_is_wrong_and_a_scope_must_name_an_interface(monkeypatch):
    # A malformed address was said to be "not a name"; a scope naming no interface was taken.
    for host, why in (("010.0.0.5", r"as IPv4: Leading zeros are not permitted in '010'"),
                      ("10.0.0.256", r"as IPv4: Octet 256 \(> 255\) not permitted"),
                      ("fe80:::1", r"as IPv6: At most one '::' permitted")):
        monkeypatch.setenv("RDT_TCP_HOST", host)
        with pytest.raises(ValueError, match=rf"RDT_TCP_HOST='{_re(host)}': give an IP address .*, not a malformed one \({why}"):
            _net.address("RDT_TCP_HOST")
    monkeypatch.setenv("RDT_TCP_HOST", "fe80::1%no-such-if")
    with pytest.raises(ValueError, match=r"RDT_TCP_HOST='fe80::1%no-such-if': its scope 'no-such-if' names no network interface of this host \(.+\); give the interface"):
        _net.address("RDT_TCP_HOST")
    index, name = socket.if_nameindex()[0]
    for scoped in (f"fe80::1%{name}", f"fe80::1%{index}"):  # by name or by index
        monkeypatch.setenv("RDT_TCP_HOST", scoped)
        assert _net.address("RDT_TCP_HOST").host == scoped


def test_ucx_settings_name_the_advertised_interface_and_the_port_range_and_yield_to_yours(monkeypatch):
    from rdt_async.transports import _ucx

    for var in ("UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE", "UCX_TCP_BRIDGE_ENABLE", "RDT_PORT_RANGE", "RDT_UCXX_HOST",
                "UCX_TCP_SYN_CNT", "UCX_TCP_CM_SYN_CNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_net, "_node_ip", None)
    monkeypatch.setattr(_net, "_node_ips", list)  # no other nodes (a session's earlier test may have handed them in)
    monkeypatch.delenv("RDT_ADVERTISE_HOST", raising=False)
    syn = {"UCX_TCP_SYN_CNT": "3", "UCX_TCP_CM_SYN_CNT": "3"}  # UCX's connects into a dropped port give up after ~15 s, not ~127 s
    assert _ucx.settings("RDT_UCXX_HOST") == syn  # outside Ray: the route out is a guess, UCX keeps its devices
    monkeypatch.setenv("RDT_ADVERTISE_HOST", "127.0.0.1")
    devices = _ucx.settings("RDT_UCXX_HOST")["UCX_NET_DEVICES"].split(",")
    assert devices[0] == "lo" and all(":" in d for d in devices[1:])  # the interface (loopback once), then RDMA ports
    monkeypatch.setattr(_net, "_node_ip", "127.0.0.1")
    monkeypatch.delenv("RDT_ADVERTISE_HOST")
    monkeypatch.setenv("RDT_PORT_RANGE", "20000-20100")
    got = _ucx.settings("RDT_UCXX_HOST")
    assert got["UCX_NET_DEVICES"].split(",")[0] == "lo" and got["UCX_TCP_PORT_RANGE"] == "20000-20100"
    assert "UCX_TCP_BRIDGE_ENABLE" not in got  # lo is no bridge
    out = _net.route_out()
    monkeypatch.setattr(_net, "_node_ips", lambda: ["127.0.0.1", out, "not an address"])  # the cluster's nodes
    assert _net.cluster_interfaces("127.0.0.1") == ["lo"] + ([_net.interface_of(out)] if out != "127.0.0.1" else [])
    monkeypatch.setattr(_net, "_node_ips", lambda: 1 / 0)  # the GCS out of reach: the node's own interface still
    assert _net.cluster_interfaces("127.0.0.1") == ["lo"]
    monkeypatch.setenv("RDT_UCXX_HOST", "192.0.2.254")  # none of this host's: behind NAT
    assert "UCX_NET_DEVICES" not in _ucx.settings("RDT_UCXX_HOST")
    monkeypatch.delenv("RDT_UCXX_HOST")
    assert _ucx.settings("RDT_UCXX_HOST", devices=False) == {"UCX_TCP_PORT_RANGE": "20000-20100", **syn}
    monkeypatch.setenv("UCX_NET_DEVICES", "all")  # yours win
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", "0")
    monkeypatch.setenv("UCX_TCP_SYN_CNT", "auto")
    assert _ucx.settings("RDT_UCXX_HOST") == {"UCX_TCP_CM_SYN_CNT": "3"}
    monkeypatch.setenv("UCX_TCP_CM_SYN_CNT", "6")
    assert _ucx.settings("RDT_UCXX_HOST") == {}
    assert _ucx.settings(_net.ADVERTISE_ENV, devices=False) == {}  # (NIXL's: the port range and SYN counts only)
    with _ucx.environment({"UCX_TCP_BRIDGE_ENABLE": "y"}):
        assert os.environ["UCX_TCP_BRIDGE_ENABLE"] == "y"
    assert "UCX_TCP_BRIDGE_ENABLE" not in os.environ  # only while a context is made


def test_nixls_ucx_keeps_to_rdt_port_range_whatever_the_address_says_and_a_bad_setting_is_named(monkeypatch):
    """NIXL's agent reads the port range only: a name in RDT_ADVERTISE_HOST (which it never
    advertises) lost a good RDT_PORT_RANGE, and a bad range was dropped without a word."""
    from rdt_async.transports import _ucx

    for var in ("UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE", "RDT_UCXX_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("UCX_TCP_SYN_CNT", "auto")
    monkeypatch.setenv("UCX_TCP_CM_SYN_CNT", "auto")
    monkeypatch.setenv("RDT_PORT_RANGE", "20000-20100")
    monkeypatch.setenv("RDT_ADVERTISE_HOST", "node-a.local")
    assert _ucx.settings(_net.ADVERTISE_ENV, devices=False) == {"UCX_TCP_PORT_RANGE": "20000-20100"}
    with pytest.raises(rdt.TransportUnavailableError, match=r"RDT_ADVERTISE_HOST='node-a.local': give an IP address"):
        _ucx.settings("RDT_UCXX_HOST")  # (ucxx's context keeps to that address's interface: it reads it)
    monkeypatch.delenv("RDT_ADVERTISE_HOST")
    monkeypatch.setenv("RDT_PORT_RANGE", "20000:20100")
    for devices in (False, True):
        with pytest.raises(rdt.TransportUnavailableError, match=r"RDT_PORT_RANGE='20000:20100': give LOW-HIGH"):
            _ucx.settings(_net.ADVERTISE_ENV, devices=devices)  # (auto takes another path; nixl named says why)


def test_a_transport_auto_may_take_that_cannot_load_here_leaves_the_actor_to_start(monkeypatch, caplog):
    """An actor loads at creation what auto may take (NIXL): a bad setting of that one
    failed every rdt.remote actor's creation on the node, though none named it."""
    from rdt_async import _produce
    from rdt_async.transports import _registry

    class Unloadable:
        def warm_up(self):
            raise rdt.TransportUnavailableError("UCX cannot be set up here: RDT_PORT_RANGE='1:2:3'")

    monkeypatch.setattr(_produce, "loads_here", lambda name: True)
    monkeypatch.setattr(_registry, "transport", lambda name: Unloadable())
    monkeypatch.setattr(_produce._ray, "hand_node_ip", lambda: None)
    _produce.warm_up(["nixl-like"], named=[])  # auto's: logged, the actor starts
    assert "nixl-like, which auto may take, is unavailable here" in caplog.text and "RDT_PORT_RANGE" in caplog.text
    with pytest.raises(rdt.TransportUnavailableError, match="RDT_PORT_RANGE"):
        _produce.warm_up(["nixl-like"], named=["nixl-like"])  # named by its methods: the creation fails, saying why


def test_ucx_settings_enable_a_bridge_that_holds_the_node_ip(monkeypatch):
    """A node IP on a Linux bridge (a container or VM network, the split rig's data
    network): UCX leaves bridges out unless told, so ucxx's context is told."""
    import subprocess

    from rdt_async.bench._hosts import Hosts
    from rdt_async.transports import _ucx

    if Hosts.unavailable():
        pytest.skip(Hosts.unavailable())
    name, ip = f"rdtbr{os.getpid() % 100000}", "10.254.254.1"
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", name], check=True)
        for var in ("UCX_NET_DEVICES", "UCX_TCP_BRIDGE_ENABLE", "RDT_UCXX_HOST", "RDT_ADVERTISE_HOST"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(_net, "_node_ip", ip)
        monkeypatch.setattr(_net, "_node_ips", list)
        got = _ucx.settings("RDT_UCXX_HOST")
        assert got["UCX_NET_DEVICES"].split(",")[:2] == [name, "lo"] and got["UCX_TCP_BRIDGE_ENABLE"] == "y", got
        monkeypatch.setenv("UCX_TCP_BRIDGE_ENABLE", "n")  # yours win
        assert "UCX_TCP_BRIDGE_ENABLE" not in _ucx.settings("RDT_UCXX_HOST")
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


def test_a_tcp_listener_binds_the_address_it_advertises_ipv6_too(monkeypatch):
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        monkeypatch.setenv("RDT_TCP_HOST", host)
        sock, where = _net.tcp_listener("RDT_TCP_HOST", "transport 'tcp'")
        with sock:
            assert sock.family == family and sock.getsockname()[0] == host and where.host == host


def test_outside_ray_a_host_whose_only_default_route_is_ipv6_advertises_that_routes_address():
    """A host with no IPv4 network (a namespace whose one link holds an IPv6 address and
    the default route): the route out was IPv4's only, so a tcp listener outside Ray
    advertised 127.0.0.1, which no other host can reach."""
    import subprocess
    import sys

    from rdt_async.bench._hosts import Hosts

    why = Hosts.unavailable()
    if why:
        pytest.skip(why)
    hosts = Hosts("split6")
    try:
        link = hosts._first
        ns = ("ip", "netns", "exec", link.name)
        subprocess.run([*ns, "ip", "route", "add", "default", "via", link.root_ip], check=True)
        code = (  # (a connect to what it advertises, from that host: the listener is there)
            "import json, socket\n"
            "from rdt_async.transports import _net\n"
            "sock, where = _net.tcp_listener('RDT_TCP_HOST', \"transport 'tcp'\")\n"
            "c = socket.create_connection((where.host, sock.getsockname()[1]), timeout=5)\n"
            "print(json.dumps([_net.route_out(), where.host, where.source, sock.family == socket.AF_INET6,\n"
            "                  sock.accept()[1][0]]))\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("RDT_TCP_HOST", "RDT_ADVERTISE_HOST")}
        run = subprocess.run([*ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert run.stdout.strip() and json.loads(run.stdout) == [link.ns_ip, link.ns_ip, _net.ROUTE_OUT, True, link.ns_ip], (
            run.stdout + run.stderr)
    finally:
        hosts.close()


# -- ports --------------------------------------------------------------------------------


def test_listeners_take_ports_of_rdt_port_range_and_say_when_it_is_exhausted(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.setenv("RDT_TCP_HOST", "127.0.0.1")
        monkeypatch.setenv("RDT_PORT_RANGE", f"{port}-{port}")
        with pytest.raises(rdt.TransportUnavailableError, match=rf"transport 'tcp' cannot listen: every port of RDT_PORT_RANGE={port}-{port} is taken; widen RDT_PORT_RANGE"):
            _net.tcp_listener("RDT_TCP_HOST", "transport 'tcp'")
        monkeypatch.setenv("RDT_PORT_RANGE", f"{port}-{port + 1}")  # one more: that one it takes
        try:
            sock, _ = _net.tcp_listener("RDT_TCP_HOST", "transport 'tcp'")
        except rdt.TransportUnavailableError:
            pytest.skip(f"port {port + 1} is taken on this machine")
        with sock:
            assert sock.getsockname()[1] == port + 1
    for bad in ("20000", "20100-20000", "0-10", "a-b", "1-70000"):
        monkeypatch.setenv("RDT_PORT_RANGE", bad)
        with pytest.raises(ValueError, match=rf"RDT_PORT_RANGE='{bad}': give LOW-HIGH"):
            _net.port_range()


@rdt.remote
class Confined:
    """A producer whose RDT_PORT_RANGE holds one port, which a socket of its own holds."""

    def __init__(self) -> None:
        import os

        ip = ray.util.get_node_ip_address()  # where tcp listens: IPv6 on split6
        self.taken = socket.create_server((ip, 0), family=socket.AF_INET6 if ":" in ip else socket.AF_INET)
        port = self.taken.getsockname()[1]
        os.environ["RDT_PORT_RANGE"] = f"{port}-{port}"

    @rdt.method(tensor_transport="auto")
    def make(self, n: int, v: float):
        return {"w": torch.full((n,), v)}

    @rdt.method(tensor_transport="tcp")
    def make_tcp(self, n: int, v: float):
        return {"w": torch.full((n,), v)}


def test_a_producer_whose_port_range_is_exhausted_still_serves_auto_and_explicit_tcp_says_why(ray_session, actors):
    producer = Confined.remote()  # fresh: its RDT_PORT_RANGE is the claim
    reader = actors["far_reader"]
    sums, used, _, _ = ray.get(reader.read.remote([producer.make.remote(1 << 20, 2.0)]))
    assert sums == [2.0 * (1 << 20)] and used == {"object_store": 1}  # tcp could not listen: the next path
    with pytest.raises(rdt.TransportUnavailableError, match=r"transport 'tcp' cannot listen: every port of RDT_PORT_RANGE=\d+-\d+ is taken"):
        ray.get(producer.make_tcp.remote(10, 1.0))
    ray.kill(producer)


# -- auto degrades, it does not fail ---------------------------------------------------------


def test_auto_falls_back_where_tcp_cannot_reach_the_producer_and_says_why_once(ray_session):
    """The producer advertises an address of its host the consumer's host has no route to
    (the head's default route, on split): auto's tcp fails to connect, the fetch takes the
    object store, says why in store_stats()["auto"] and in one log line, and leaves tcp
    out for that node's later objects. An explicit tcp fetch fails, naming address and setting."""
    _split(ray_session)
    out = _net.route_out()
    if out.startswith("127."):
        pytest.skip("this host has no default route to advertise")
    # Both fresh: the producer's RDT_TCP_HOST is the claim, and the consumer's memory of the
    # unreachable node (and its one log line) must not outlive this test into a shared one.
    head = Producer.options(runtime_env={"env_vars": {"RDT_TCP_HOST": out}}).remote()
    reader = Consumer.options(**ON_NODE2).remote()
    n = 1 << 20  # 4 MiB: over auto's inline limit, so it asks for a path
    sums, used, choices, said = ray.get(reader.read.remote([head.make.remote(n, 1.0), head.make.remote(n, 2.0)]))
    assert sums == [float(n), 2.0 * n] and used == {"object_store": 2}
    first, second = choices
    assert first["transport"] == "object_store" and [f["transport"] for f in first["fell_back"]] == ["tcp"]
    assert "Network is unreachable" in first["fell_back"][0]["why"] and out in first["fell_back"][0]["why"]
    assert second["transport"] == "object_store" and "tcp left out: could not reach that node lately" in second["why"]
    assert len([s for s in said if "auto could not use tcp" in s]) == 1, said
    error = ray.get(reader.read_error.remote([head.make_tcp.remote(10, 1.0)]))
    assert error.startswith("TransferError: tcp fetch of") and f"cannot reach the producer's tcp listener at {out}:" in error
    assert "RDT_TCP_HOST" in error and "RDT_ADVERTISE_HOST" in error
    # The consumer's own choice of tcp, for an object produced with auto, fails as well: it
    # asked for that path (before: it fell back to the object store without a word).
    error = ray.get(reader.read_error.remote([head.make.remote(n, 3.0)], "tcp"))
    assert error.startswith("TransferError: tcp fetch of") and f"cannot reach the producer's tcp listener at {out}:" in error
    ray.kill(head)
    ray.kill(reader)


# -- a ref's address is input (issue 28) ---------------------------------------------------


def _fetch(transport, meta, obj_id: str = "crafted") -> list[torch.Tensor]:
    info = TransferInfo(obj_id, (TensorSpec((4,), torch.float32, "cpu", 16),), meta)
    return FetchRequest.start(transport, info).result(10)


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (tcp.TcpMeta("localhost", 1, bytes(16)), "host 'localhost' is not an IP address"),
        (tcp.TcpMeta("../../etc/passwd", 1, bytes(16)), "host '../../etc/passwd' is not an IP address"),
        (tcp.TcpMeta(2130706433, 1, bytes(16)), "host 2130706433 is not an IP address"),  # an int is an address to ipaddress
        # Where no producer listens (a consumer connecting to 0.0.0.0 or :: reaches its own host):
        (tcp.TcpMeta("0.0.0.0", 1, bytes(16)), "host '0.0.0.0' is the unspecified address, where no producer listens"),
        (tcp.TcpMeta("::", 1, bytes(16)), "host '::' is the unspecified address, where no producer listens"),
        (tcp.TcpMeta("::ffff:0.0.0.0", 1, bytes(16)), "host '::ffff:0.0.0.0' is the unspecified address, where no producer listens"),
        (tcp.TcpMeta("224.0.0.1", 1, bytes(16)), "host '224.0.0.1' is a multicast address, where no producer listens"),
        (tcp.TcpMeta("ff02::1", 1, bytes(16)), "host 'ff02::1' is a multicast address, where no producer listens"),
        (tcp.TcpMeta("255.255.255.255", 1, bytes(16)), "host '255.255.255.255' is the broadcast address, where no producer listens"),
        (tcp.TcpMeta("127.0.0.1", 0, bytes(16)), "port 0 is not in 1..65535"),
        (tcp.TcpMeta("127.0.0.1", 70000, bytes(16)), "port 70000 is not in 1..65535"),
        (tcp.TcpMeta("127.0.0.1", "80", bytes(16)), "port '80' is not in 1..65535"),
        (tcp.TcpMeta("127.0.0.1", True, bytes(16)), "port True is not in 1..65535"),
        (tcp.TcpMeta("127.0.0.1", 1, bytes(15)), "the token is not 16 bytes"),
        (tcp.TcpMeta("127.0.0.1", 1, "x" * 16), "the token is not 16 bytes"),
        (("127.0.0.1", 1, bytes(16)), "not tcp metadata: tuple"),
    ],
)
def test_crafted_tcp_metadata_is_refused_before_anything_connects(meta, why):
    with socket.socket() as listener:  # where a name resolving to loopback would connect: nobody may
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.05)
        with pytest.raises(rdt.TransferError, match=rf"tcp fetch of crafted: the ref's tcp metadata is malformed \({_re(why)}\); nothing was read"):
            _fetch(tcp.TcpTransport(), meta)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (("localhost", 13337), "host 'localhost' is not an IPv4 address"),
        (("fd00::1", 13337), "host 'fd00::1' is not an IPv4 address"),  # UCXX listens on IPv4 only
        (("127.0.0.1", 0), "port 0 is not in 1..65535"),
        (("0.0.0.0", 13337), "host '0.0.0.0' is the unspecified address, where no producer listens"),
        (("127.0.0.1", 65536), "port 65536 is not in 1..65535"),
        (("127.0.0.1", 1.5), "port 1.5 is not in 1..65535"),
        (("127.0.0.1", 13337, b"short"), "the token is not 16 bytes"),
        (("127.0.0.1", 13337, "x" * 16), "the token is not 16 bytes"),
    ],
)
def test_crafted_ucxx_metadata_is_refused_before_ucx_loads(meta, why):
    import sys

    from rdt_async.transports import ucxx

    with pytest.raises(rdt.TransferError, match=rf"ucxx fetch of crafted: the ref's ucxx metadata is malformed \({_re(why)}\)"):
        _fetch(ucxx.UcxxTransport(), ucxx.UcxxMeta(*meta) if len(meta) == 3 else ucxx.UcxxMeta(*meta, bytes(16)))
    assert "ucxx._lib.libucxx" not in sys.modules  # refused before UCXX (and its UCX) loaded here


@pytest.mark.parametrize(("missing", "why"), [("token", "the token is not 16 bytes"), ("host", "host None is not an IPv4 address")])
def test_ucxx_metadata_lacking_a_field_is_refused_as_malformed(missing, why):
    # A UcxxMeta unpickled from an older version (before the token), or crafted: the
    # check raised a bare AttributeError.
    from rdt_async.transports import ucxx

    meta = object.__new__(ucxx.UcxxMeta)
    for name, value in (("host", "127.0.0.1"), ("port", 13337), ("token", bytes(16))):
        if name != missing:
            object.__setattr__(meta, name, value)
    with pytest.raises(rdt.TransferError, match=rf"ucxx fetch of crafted: the ref's ucxx metadata is malformed \({_re(why)}\)"):
        _fetch(ucxx.UcxxTransport(), meta)


def test_a_tcp_request_for_too_many_ranges_is_dropped_before_it_is_read():
    t = tcp.TcpTransport()
    meta = t.prepare("ranges", [torch.ones(4)])
    try:
        with socket.create_connection((meta.host, meta.port), timeout=10) as sock:
            assert tcp._recv_exact(sock, 16) == tcp._greeting(meta.token)
            sock.sendall(tcp.MAGIC + meta.token + tcp._HEAD.pack(6, 0xFFFFFFFF, 0) + b"ranges")
            try:
                assert sock.recv(1) == b""  # closed: no 80 GiB body awaited, nothing allocated
            except ConnectionResetError:
                pass  # closed with our bytes unread: the same
    finally:
        t.garbage_collect("ranges", meta)


def _re(text: str) -> str:
    import re

    return re.escape(text)
