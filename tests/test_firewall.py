"""A producer's host behind a firewall, as users run them: inbound TCP only to Ray's ports
and to the range opened for rdt_async (RDT_PORT_RANGE); a connection to any other port
gets no answer (dropped, not refused: a connect waits out its timeout, the worst case).

The firewall is tc filters on the host's end of its link (`_hosts._Link.admit_only`),
set before its `ray start`, which is given every port Ray listens on there. Needs the
split topology (network namespaces).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import ipaddress
import logging
import socket
import time

import pytest
import ray
import torch
from helpers import Said
from probes import listening

import rdt_async as rdt
from rdt_async.transports import tcp

RAY_PORTS = (21500, 21599)  # every port Ray listens on at the walled host
OPENED = (21600, 21631)  # the range its user opens for rdt_async: RDT_PORT_RANGE
N = 16 << 20  # 64 MiB of float32
WALLED = {"num_cpus": 0, "resources": {"walled": 1}}
IN_RANGE = {"runtime_env": {"env_vars": {"RDT_PORT_RANGE": f"{OPENED[0]}-{OPENED[1]}"}}}
UCXX = importlib.util.find_spec("ucxx") is not None
NIXL = importlib.util.find_spec("nixl") is not None


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


@rdt.remote
class Producer:
    def __init__(self) -> None:
        self.before = listening()  # Ray's own

    @rdt.method(tensor_transport="auto")
    def make(self, n: int, seed: int):
        return {"w": _values(n, seed)}

    @rdt.method(tensor_transport="tcp")
    def make_tcp(self, n: int, seed: int):
        return {"w": _values(n, seed)}

    def tcp_address(self) -> tuple[str, int]:
        meta = tcp._listening().meta
        return meta.host, meta.port

    def listening(self) -> list[tuple[str, int]]:
        """What listens since it was made: rdt_async's (and UCX's) listeners."""
        return sorted(listening() - self.before)


@rdt.remote
class Consumer:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        import os

        os.environ.update(env or {})
        self.said = Said()
        logging.getLogger("rdt_async").addHandler(self.said)

    async def read(self, refs, tensor_transport=None) -> dict:
        """The value's digest, the path it took, auto's record of it, how long it took.
        (`refs`: one ref in a list, which the call does not fetch for it.)"""
        (ref,) = refs
        before = collections.Counter(rdt.store_stats()["fetches"])
        t0 = time.monotonic()
        try:
            got = await rdt.fetch(ref, tensor_transport=tensor_transport)
        except rdt.RDTError as e:
            return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - t0}
        s = time.monotonic() - t0
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        auto = rdt.store_stats()["auto"]
        return {"digest": _digest(got["w"]), "used": dict(used), "auto": auto[-1] if auto else None,
                "s": s, "said": list(self.said.lines)}


QUICK_SYN = {"UCX_TCP_SYN_CNT": "1", "UCX_TCP_CM_SYN_CNT": "1"}  # UCX's connects give up after ~4 s (a user's own: it wins)


def _split(cluster) -> None:
    if cluster.hosts is None or cluster.hosts.topology != "split":
        pytest.skip("needs the split topology (RDT_TEST_TOPOLOGY=split or three, network namespaces)")


@pytest.fixture(scope="module")
def walled(cluster):
    """A host whose firewall admits inbound TCP to Ray's ports and to OPENED only."""
    _split(cluster)
    ports = [f"--node-manager-port={RAY_PORTS[0]}", f"--object-manager-port={RAY_PORTS[0] + 1}",
             f"--runtime-env-agent-port={RAY_PORTS[0] + 2}", f"--dashboard-agent-grpc-port={RAY_PORTS[0] + 3}",
             f"--dashboard-agent-listen-port={RAY_PORTS[0] + 4}", f"--metrics-export-port={RAY_PORTS[0] + 5}",
             f"--min-worker-port={RAY_PORTS[0] + 10}", f"--max-worker-port={RAY_PORTS[1]}"]
    hosts = cluster.hosts
    node = hosts.add("walled", cluster.address, {"walled": 1000}, start_args=["--include-log-monitor=False", *ports],
                     admit=[RAY_PORTS, OPENED])
    try:
        yield node
    finally:
        hosts.remove("walled")


@pytest.fixture(scope="module")
def actors(walled):
    made = {
        "opened": Producer.options(**WALLED, **IN_RANGE).remote(),  # its listeners in OPENED
        "shut": Producer.options(**WALLED).remote(),  # its listeners on ephemeral ports: dropped
        "reader": Consumer.remote(),
    }
    yield made
    for actor in made.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def ucx_reader(walled):
    """A consumer on the head for each of nixl and ucxx (a process loads one of their UCX
    builds), made on first use, whose UCX gives its connects up after ~4 s (QUICK_SYN):
    shared by the reads across the firewall and the fetches it drops (each test's producer
    is fresh; a reader's earlier fetches change neither outcome)."""
    made = {}

    def reader(transport: str):
        if transport not in made:
            made[transport] = Consumer.options(runtime_env={"env_vars": QUICK_SYN}).remote()
        return made[transport]

    yield reader
    for actor in made.values():
        ray.kill(actor)


def test_a_firewalls_port_ranges_are_the_aligned_blocks_a_u32_match_takes():
    from rdt_async.bench._hosts import _port_blocks

    for low, high in ((21500, 21599), (21600, 21631), (1, 1), (65535, 65535), (1, 65535)):
        blocks = _port_blocks(low, high)
        admitted = {p for value, mask in blocks for p in range(low & ~0x3FF, min(high + 0x400, 65536)) if p & mask == value}
        assert admitted == set(range(low, high + 1)) and all(v & ~m == 0 for v, m in blocks), (low, high, blocks)
    assert _port_blocks(21600, 21631) == [(21600, 0xFFE0)]
    with pytest.raises(ValueError, match="ports 0-10: give 0 < LOW <= HIGH < 65536"):
        _port_blocks(0, 10)


def test_the_firewall_admits_rays_ports_and_the_opened_range_and_drops_the_rest(ray_session, walled, actors):
    host, port = ray.get(actors["opened"].tcp_address.remote())
    assert host == walled.ip and OPENED[0] <= port <= OPENED[1]
    socket.create_connection((host, port), timeout=5).close()
    host, port = ray.get(actors["shut"].tcp_address.remote())  # (Ray's calls reach it: its ports are open)
    assert not OPENED[0] <= port <= RAY_PORTS[1]
    with pytest.raises(TimeoutError):
        socket.create_connection((host, port), timeout=0.5)  # no answer, not refused


def test_tcp_and_auto_read_64_mib_exactly_across_the_firewall_in_rdt_port_range(ray_session, actors):
    opened, reader = actors["opened"], actors["reader"]
    want = _digest(_values(N, 1))
    for ref, transport in ((opened.make.remote(N, 1), None), (opened.make_tcp.remote(N, 1), None),
                           (opened.make.remote(N, 1), "tcp")):
        got = ray.get(reader.read.remote([ref], transport))
        print(f"\nopened range, {transport or 'as produced'}: {got['s']:.2f} s")
        assert got.get("digest") == want and got["used"] == {"tcp": 1}, got
    listens = ray.get(opened.listening.remote())
    assert listens and all(OPENED[0] <= p <= OPENED[1] for _, p in listens), listens


@pytest.mark.parametrize("transport", [
    pytest.param("ucxx", marks=pytest.mark.skipif(not UCXX, reason="ucxx is not installed")),
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="nixl is not installed")),
])
def test_ucx_reads_across_the_firewall_on_ports_of_rdt_port_range(ray_session, walled, ucx_reader, transport):
    producer = Producer.options(**WALLED, **IN_RANGE).remote()  # fresh: what listens since it made UCX's context
    reader = ucx_reader(transport)
    try:
        got = ray.get(reader.read.remote([producer.make.options(tensor_transport=transport).remote(1 << 20, 2)]), timeout=120)
        print(f"\n{transport} in the opened range: {got['s']:.2f} s")
        assert got.get("digest") == _digest(_values(1 << 20, 2)) and got["used"] == {transport: 1}, got
        listens = ray.get(producer.listening.remote())
        assert listens and all(OPENED[0] <= p <= OPENED[1] for _, p in listens), listens
    finally:
        ray.kill(producer)


CONNECT_S = 2  # the consumer's RDT_TCP_CONNECT_S: how long a connect into the dropped port waits


def test_auto_falls_back_past_a_firewall_that_drops_its_port_and_explicit_tcp_names_rdt_port_range(ray_session, walled, actors):
    """The producer's listener on an ephemeral port, which the firewall drops: auto's tcp
    gets no answer, the fetch takes the object store after RDT_TCP_CONNECT_S (it was 10 s,
    with no setting), says why once, and leaves tcp out for that host's next objects; an
    explicit tcp fetch fails naming the address and RDT_PORT_RANGE."""
    shut = actors["shut"]
    reader = Consumer.remote({"RDT_TCP_CONNECT_S": str(CONNECT_S)})  # fresh: its memory of the walled host is this test's
    try:
        n = 1 << 20  # 4 MiB: over auto's inline limit, so it asks for a path
        want = [_digest(_values(n, seed)) for seed in (3, 4)]
        first = ray.get(reader.read.remote([shut.make.remote(n, 3)]))
        second = ray.get(reader.read.remote([shut.make.remote(n, 4)]))
        print(f"\nport dropped, auto: first fetch {first['s']:.2f} s, second {second['s']:.2f} s")
        assert [first.get("digest"), second.get("digest")] == want, (first, second)
        assert first["used"] == second["used"] == {"object_store": 1}
        assert CONNECT_S <= first["s"] < CONNECT_S + 3, first["s"]  # the connect's wait, then the object store
        fell = first["auto"]["fell_back"]
        assert [f["transport"] for f in fell] == ["tcp"] and f"{walled.ip}:" in fell[0]["why"], first["auto"]
        assert f"no answer in {CONNECT_S} s (RDT_TCP_CONNECT_S): a firewall drops that port" in fell[0]["why"], fell
        assert "RDT_PORT_RANGE" in fell[0]["why"], fell
        assert "tcp left out: could not reach that node lately" in second["auto"]["why"], second["auto"]
        assert second["s"] < CONNECT_S, second["s"]  # no connect timeout paid again
        assert len([s for s in second["said"] if "auto could not use tcp" in s]) == 1, second["said"]
        error = ray.get(reader.read.remote([shut.make_tcp.remote(10, 5)]))
        print(f"explicit tcp: {error['s']:.2f} s: {error.get('error')}")
        assert error.get("error", "").startswith("TransferError: tcp fetch of"), error
        assert f"cannot reach the producer's tcp listener at {walled.ip}:" in error["error"]
        assert "a firewall drops that port" in error["error"] and "RDT_PORT_RANGE" in error["error"]
    finally:
        ray.kill(reader)


def test_a_nixl_producer_that_cannot_be_connected_to_is_unreachable_not_dead():
    """NIXL's connect into a port a firewall drops fails (after the kernel's SYN retries:
    136 s here) as a connect to a dead producer does: that was PeerDiedError, "it died or
    is unreachable", so a live producer behind a firewall was marked lost and `auto`
    never fell back. Now a TransferError from `Unreachable` naming RDT_PORT_RANGE: the
    core asks Ray whether the producer died, and `auto` takes another path if not."""
    import asyncio

    from rdt_async._avoid import unusable
    from rdt_async.transports.nixl import _peers
    from rdt_async.transports.nixl._meta import NixlMeta

    class Nixl:
        def add_remote_agent(self, conn: bytes) -> bytes:
            raise RuntimeError("NIXL_ERR_BACKEND")  # (nixlBackendError: what NIXL 1.5 raised)

    class Agent:
        nixl = Nixl()

        async def call(self, fn, *args, slow=False):
            return fn(*args)

    peers = _peers.Peers(Agent(), lambda meta: None)  # (another host's producer: not checkable here)
    meta = NixlMeta("rdt-walled-7", b"conn", (), (), 0, 0, 7, "rdt-walled")
    with pytest.raises(rdt.TransferError) as caught:
        asyncio.run(peers.connect(meta))
    assert not isinstance(caught.value, rdt.PeerDiedError)
    assert str(caught.value).startswith("nixl: cannot connect to the producer's agent rdt-walled-7 (pid 7 on rdt-walled) "
                                        "(RuntimeError: NIXL_ERR_BACKEND): it died, or a firewall drops UCX's connection")
    assert "set RDT_PORT_RANGE to ports the firewall admits" in str(caught.value)
    assert unusable(caught.value) is not None and len(peers) == 0  # auto's next path; no connection kept


@pytest.mark.parametrize(("transport", "says"), [
    pytest.param("ucxx", "(UCXXUnreachableError: Endpoint 0x", marks=pytest.mark.skipif(not UCXX, reason="ucxx is not installed")),
    pytest.param("nixl", "a firewall drops UCX's connection", marks=pytest.mark.skipif(not NIXL, reason="nixl is not installed")),
])
def test_ucx_across_a_firewall_that_drops_its_port_fails_as_unreachable_naming_rdt_port_range(ray_session, walled, ucx_reader,
                                                                                               transport, says):
    """Without RDT_PORT_RANGE, UCX's (and ucxx's) listeners take ports the firewall drops:
    both fetches ended in PeerDiedError ("died or closed", "died or is unreachable") from
    a live producer, which the consumer then took for lost. Now a TransferError from
    `Unreachable` naming the setting (the core asks Ray whether the producer died), once
    UCX gives the connect up (here ~4 s: QUICK_SYN; by default ~15 s, rdt_async's
    UCX_TCP_SYN_CNT and UCX_TCP_CM_SYN_CNT; the kernel's own ~127 s outlasted ucxx's
    answer wait, RDT_UCXX_ANSWER_S, 120 s, whose error names the setting too)."""
    producer = Producer.options(**WALLED).remote()
    reader = ucx_reader(transport)
    try:
        ref = producer.make.options(tensor_transport=transport).remote(1 << 20, 6)
        got = ray.get(reader.read.remote([ref]), timeout=120)
        print(f"\n{transport}, its port dropped: {got['s']:.2f} s: {got.get('error')}")
        assert got.get("error", "").startswith(f"TransferError: {transport}"), got
        assert says in got["error"] and "a firewall drops" in got["error"], got
        assert "where the producer runs, set RDT_PORT_RANGE to ports the firewall admits" in got["error"], got
        again = ray.get(reader.read.remote([producer.make.options(tensor_transport="object_store").remote(1 << 20, 6)]))
        assert again.get("digest") == _digest(_values(1 << 20, 6)), again  # the producer is not taken for dead
    finally:
        ray.kill(producer)


# -- the consumer's host behind the firewall: the producers run on the open head --------------


@pytest.fixture(scope="module")
def inside(walled):
    """Two consumers on the walled host without RDT_PORT_RANGE (their listeners, UCX's
    too, on ports the firewall drops: as on a host that admits only Ray's ports), and a
    producer on the open head whose UCX gives its connects up after ~4 s (QUICK_SYN)."""
    made = {"a": Consumer.options(**WALLED).remote(), "b": Consumer.options(**WALLED).remote(),
            "producer": Producer.options(runtime_env={"env_vars": QUICK_SYN}).remote()}
    yield made
    for actor in made.values():
        ray.kill(actor)


def test_a_walled_consumer_reads_over_tcp_auto_and_its_nodes_relay_with_only_rays_ports_open(ray_session, walled, inside):
    """Each of these connects from the consumer out: nothing reaches the consumer's host
    but Ray's own traffic, so no port of rdt_async's needs opening there."""
    a, b, producer = inside["a"], inside["b"], inside["producer"]
    ref = producer.make.remote(N, 7)  # (auto: tcp across nodes; a's and b's node relay shares one read)
    got = ray.get([a.read.remote([ref]), b.read.remote([ref])], timeout=60)
    print(f"\nwalled consumers, auto: {[round(g['s'], 2) for g in got]} s, {[g.get('used') for g in got]}")
    assert [g.get("digest") for g in got] == [_digest(_values(N, 7))] * 2, got
    assert all(list(g["used"]) in (["tcp"], ["relay"]) for g in got), got  # (relayed where the reads overlapped)
    got = ray.get(a.read.remote([producer.make_tcp.remote(1 << 20, 8)]), timeout=60)
    assert got.get("digest") == _digest(_values(1 << 20, 8)) and got["used"] == {"tcp": 1}, got


@pytest.mark.skipif(not UCXX, reason="ucxx is not installed")
def test_ucxx_into_a_walled_consumer_needs_its_rdt_port_range_and_says_so_not_that_the_producer_died(ray_session, walled, inside):
    """UCX's TCP connects from the producer back to the consumer's UCX port: into a
    consumer whose firewall drops that port, the producer gives the connect up (~4 s
    here) and the endpoint fails before the greeting. That was PeerDiedError, "the
    producer ... died or closed", from a live producer; now a TransferError from
    `Unreachable` (the core asks Ray whether it died) naming RDT_PORT_RANGE on this host.
    With RDT_PORT_RANGE set where it runs (and admitted), a consumer on that host reads."""
    b, producer = inside["b"], inside["producer"]
    opened = Consumer.options(**WALLED, **IN_RANGE).remote()
    try:
        got = ray.get(b.read.remote([producer.make.options(tensor_transport="ucxx").remote(1 << 20, 10)]), timeout=60)
        print(f"\nucxx into a walled consumer: {got['s']:.2f} s: {got.get('error')}")
        assert got.get("error", "").startswith("TransferError: ucxx fetch of "), got
        assert "failed before its greeting" in got["error"] and "it died, or a firewall drops UCX's connections" in got["error"]
        assert "UCX also connects from the producer back to this process: where a firewall guards this host, set " \
               "RDT_PORT_RANGE here too, to ports it admits" in got["error"], got
        assert got["s"] < 15, got["s"]
        ok = ray.get(opened.read.remote([producer.make.options(tensor_transport="ucxx").remote(1 << 20, 11)]), timeout=60)
        print(f"ucxx into a walled consumer in RDT_PORT_RANGE: {ok['s']:.2f} s")
        assert ok.get("digest") == _digest(_values(1 << 20, 11)) and ok["used"] == {"ucxx": 1}, ok
    finally:
        ray.kill(opened)


def test_a_gloo_group_whose_member_a_firewall_walls_off_fails_in_about_5x_timeout_s_naming_the_ports(ray_session, cluster, walled, inside):
    """Gloo connects each pair from the member of the higher address: one above the
    walled host connects into its Gloo listener (an ephemeral port), which the firewall
    drops. The join failed after ~5x timeout_s with "Connect timeout [none]" and no word
    of why; now the error names the member's address and the ports to open."""
    cluster.hosts.add("above", cluster.address, {"above": 1000}, start_args=["--include-log-monitor=False"])
    try:
        assert ipaddress.ip_address(cluster.hosts.node("above").ip) > ipaddress.ip_address(walled.ip)
        above = Consumer.options(num_cpus=0, resources={"above": 1}).remote()
        ray.get(above.__ray_ready__.remote(), timeout=60)  # (up: timeout_s bounds the join, not its start)
        t0 = time.monotonic()
        with pytest.raises(rdt.CollectiveGroupError) as caught:
            rdt.create_collective_group([inside["a"], above], backend="gloo", timeout_s=0.5)  # (~2.5 s; 1 s: ~5 s)
        took = time.monotonic() - t0
        print(f"\ngloo across the firewall: {took:.2f} s: {caught.value}")
        said = str(caught.value)
        assert "Connect timeout" in said and "a firewall between their hosts may drop Gloo's connections" in said, said
        assert "open the ephemeral range (net.ipv4.ip_local_port_range) between the members' hosts" in said, said
        assert f"listening on {walled.ip}" in said or f"listening on {cluster.hosts.node('above').ip}" in said, said
        assert took < 15, took
    finally:
        cluster.hosts.remove("above")
