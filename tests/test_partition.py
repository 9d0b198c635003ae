"""A partition: the link to the producer's host goes down while a consumer fetches.

The producer runs on a host of its own (a network namespace of conftest's hosts, not the
session's node2), the consumer on the head host. While the link is down a fetch with a
deadline ends at it with TimeoutError and the consumer serves on; once the link is back
the same object arrives whole. A link that stays down ends the fetch with PeerDiedError
once Ray declares the host dead, and never hangs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest
import ray
import torch

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

N = 1 << 22  # 16 MiB of float32


def _optional(name: str, module: str):
    if importlib.util.find_spec(module):
        return name
    return pytest.param(name, marks=pytest.mark.skip(f"{module} not installed"))


TRANSPORTS = ["auto", "object_store", "tcp", "gloo", _optional("nixl", "nixl"), _optional("ucxx", "ucxx")]


def _producer(transport: str):
    @rdt.remote
    class Producer:
        @rdt.method(tensor_transport=transport)
        def make(self, step: int):
            return {"w": torch.full((N,), float(step))}

        def ping(self) -> str:
            return "pong"

    return Producer


@rdt.remote
class Consumer:
    async def fetch_total(self, refs, within: float | None) -> float:
        async with asyncio.timeout(within):
            return float((await rdt.fetch(refs[0]))["w"].sum())

    async def ping(self) -> str:
        return "pong"


def _far_host(cluster, name: str):
    if cluster.hosts is None:
        pytest.skip("a partition needs hosts of their own: network namespaces (Linux, root)")
    return cluster.hosts.add(name, cluster.address, {name: 1000})


@pytest.fixture(scope="module")
def far(cluster):
    host = _far_host(cluster, "far")
    yield host
    cluster.hosts.remove("far")


def _pair(transport: str, where: str):
    producer = _producer(transport).options(num_cpus=0, resources={where: 1}).remote()
    consumer = Consumer.remote()
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    return producer, consumer, group


def _close(producer, consumer, group) -> None:
    if group is not None:
        rdt.destroy_collective_group(group)
    ray.kill(producer)
    ray.kill(consumer)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_fetch_across_a_partition_ends_at_its_deadline_and_succeeds_once_the_link_heals(far, transport):
    producer, consumer, group = _pair(transport, "far")
    try:
        warm = producer.make.remote(1)
        assert ray.get(consumer.fetch_total.remote([warm], 60), timeout=90) == 1.0 * N  # connections made
        ref = producer.make.remote(2)
        ray.wait([ref], timeout=60)
        far.link.set_up(False)
        try:
            started = time.monotonic()
            pending = consumer.fetch_total.remote([ref], 3.0)
            assert ray.get(consumer.ping.remote(), timeout=5) == "pong"  # its loop is free meanwhile
            with pytest.raises(TimeoutError) as raised:
                ray.get(pending, timeout=60)
            assert not isinstance(raised.value, ray.exceptions.GetTimeoutError)  # the fetch's own deadline
            took = time.monotonic() - started
            assert 2.5 < took < 15, took
            print(f"\n{transport}: link down, a 3 s deadline ended the fetch after {took:.2f} s")
        finally:
            far.link.set_up(True)
        assert ray.get(consumer.fetch_total.remote([ref], 60), timeout=90) == 2.0 * N
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"
    finally:
        _close(producer, consumer, group)


def test_a_link_that_stays_down_ends_every_fetch_with_peer_died_error(cluster):
    host = _far_host(cluster, "cut")
    pairs = {t: _pair(t, "cut") for t in ("object_store", "gloo", "nixl", "ucxx") if importlib.util.find_spec(t) or t in ("object_store", "gloo")}
    try:
        refs = {}
        for t, (producer, consumer, _) in pairs.items():
            assert ray.get(consumer.fetch_total.remote([producer.make.remote(1)], 60), timeout=90) == 1.0 * N
            refs[t] = producer.make.remote(3)
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=60)
        host.link.set_up(False)
        started = time.monotonic()
        pending = {t: pairs[t][1].fetch_total.remote([ref], None) for t, ref in refs.items()}
        outcomes = {}
        for t, p in pending.items():
            try:
                outcomes[t] = ray.get(p, timeout=max(1.0, 120 - (time.monotonic() - started)))
            except rdt.PeerDiedError as e:
                outcomes[t] = f"PeerDiedError after {time.monotonic() - started:.0f} s"
                assert "died" in str(e) or "disconnected" in str(e), str(e)
            except Exception as e:
                outcomes[t] = f"{type(e).__name__} after {time.monotonic() - started:.0f} s: {str(e)[-300:]}"
        print(f"\nlink down for good: {outcomes}")
        assert {t: o.split(" after")[0] for t, o in outcomes.items()} == dict.fromkeys(refs, "PeerDiedError"), outcomes
        assert time.monotonic() - started < 90
        assert {ray.get(c.ping.remote(), timeout=10) for _, c, _ in pairs.values()} == {"pong"}
    finally:
        for producer, consumer, group in pairs.values():
            _close(producer, consumer, group)
        cluster.hosts.remove("cut")
