"""Three hosts: a producer on one host, its consumers on another, neither of them the head.

Every other cross-host test reads between the head and one host, so an address that only
the head can reach (the head's own, a route through it) would pass them all. Here the
producer runs on node2 and the consumers on a third host, node3: what the producer
advertises must reach node3 directly, on the data network (split topology: the hosts
have no default route, and the head forwards nothing between them).

A third host is added for the module (or the session's, under RDT_TEST_TOPOLOGY=three).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util

import pytest
import ray
import torch
from conftest import ON_NODE2, TOPOLOGY, UCXX_REFUSED
from helpers import SyncProducer

import rdt_async as rdt

ON_NODE3 = {"num_cpus": 0, "resources": {"node3": 1}}
N = 4 << 20  # 16 MiB of float32
UCXX = importlib.util.find_spec("ucxx") is not None
NIXL = importlib.util.find_spec("nixl") is not None


@rdt.remote
class Reader:
    async def read(self, refs, **kw) -> tuple[str, dict[str, int], list]:
        """The fetched value's digest, the paths this fetch took, and auto's fallbacks
        (`refs`: one ref in a list, which the call does not fetch for it)."""
        before = collections.Counter(rdt.store_stats()["fetches"])
        value = await rdt.fetch(refs[0], **kw)
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        auto = rdt.store_stats()["auto"]
        return _digest(value["w"]), dict(used), auto[-1].get("fell_back", []) if auto else []

    async def ping(self) -> int:
        return 1


@pytest.fixture(scope="module")
def node3(cluster):
    hosts = cluster.hosts
    if hosts is None or hosts.topology == "flat":
        pytest.skip("needs hosts joined by a data network (split, three or split6): in the flat rig "
                    "hosts reach each other only through the head, which forwards nothing here")
    added = TOPOLOGY != "three"
    if added:
        hosts.add("node3", cluster.address, {"node3": 1000}, start_args=["--include-log-monitor=False"])
    try:
        yield hosts.node("node3")
    finally:
        if added:
            hosts.remove("node3")


@pytest.fixture(scope="module")
def actors(node3):
    made = {
        "producer": SyncProducer.options(**ON_NODE2).remote(),
        "a": Reader.options(**ON_NODE3).remote(),
        "b": Reader.options(**ON_NODE3).remote(),
    }
    ray.get([made["producer"].pid.remote(), made["a"].ping.remote(), made["b"].ping.remote()])
    yield made
    for actor in made.values():
        ray.kill(actor)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def _want(n: int, seed: int) -> str:
    return _digest(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def test_auto_reads_across_two_hosts_without_falling_back(ray_session, actors):
    """Two consumers on node3 read one 16 MiB object of node2's at once: exact, over a
    path that crosses hosts (a fallback to the object store would hide an address only
    the head reaches); one of them may be served by the other's read (the node relay)."""
    ref = actors["producer"].make.remote(N, 7)
    got = ray.get([actors[k].read.remote([ref]) for k in ("a", "b")], timeout=120)
    assert [sum_ for sum_, _, _ in got] == [_want(N, 7)] * 2
    used = collections.Counter()
    for _, paths, fell_back in got:
        used.update(paths)
        assert fell_back == [], fell_back
    assert sum(used.values()) == 2 and set(used) <= {"tcp", "relay", "nixl", "ucxx"}, used


@pytest.mark.parametrize("transport", [
    "tcp",
    pytest.param("ucxx", marks=[pytest.mark.skipif(not UCXX, reason="ucxx is not installed"),
                                pytest.mark.skipif(UCXX_REFUSED is not None, reason=UCXX_REFUSED or "")]),
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="nixl is not installed")),
])
def test_each_transport_reads_from_one_host_on_another(ray_session, actors, transport):
    n = N if transport == "tcp" else 1 << 18  # (UCX over TCP here: 1 MiB is enough to cross)
    producer, reader = actors["producer"], actors["a"]
    # (A process loads one of nixl's and ucxx's UCX builds: these load ucxx's. b loads no
    # ucxx: auto, which it reads with, may take nixl, never ucxx.)
    if transport == "nixl":
        producer, reader = SyncProducer.options(**ON_NODE2).remote(), actors["b"]
    try:
        ref = producer.make.options(tensor_transport=transport).remote(n, 11)
        got, used, _ = ray.get(reader.read.remote([ref]), timeout=120)
        assert (got, used) == (_want(n, 11), {transport: 1})
    finally:
        if transport == "nixl":
            ray.kill(producer)


def test_a_gloo_group_of_two_hosts_that_are_not_the_head(ray_session, actors):
    producer, a = actors["producer"], actors["a"]
    group = rdt.create_collective_group([producer, a], backend="gloo", name="three-hosts")
    try:
        ref = producer.make.options(tensor_transport="gloo").remote(N, 13)
        got, used, _ = ray.get(a.read.remote([ref]), timeout=120)
        assert (got, used) == (_want(N, 13), {"gloo": 1})
    finally:
        rdt.destroy_collective_group(group)
