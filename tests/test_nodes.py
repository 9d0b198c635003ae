"""Two nodes on one machine: `auto` never picks shared memory across nodes."""

from __future__ import annotations

import collections

import pytest
import ray
import torch
from conftest import ON_NODE2, wait_until
from helpers import SyncProducer, checksum

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")


@rdt.remote
class Reader:
    async def read(self, refs):
        before = collections.Counter(rdt.store_stats()["fetches"])
        values = await rdt.fetch_all(refs)
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        return [checksum(v) for v in values], dict(used), ray.get_runtime_context().get_node_id()

    async def hold(self, refs):
        """Fetch refs and keep the values (until drop): the sums, and the transports used."""
        before = collections.Counter(rdt.store_stats()["fetches"])
        self.values = await rdt.fetch_all(refs)
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        return [float(v["w"].sum()) + float(v["small"].sum()) for v in self.values], dict(used)

    async def drop(self) -> None:
        self.values = None


@pytest.fixture(scope="module")
def actors(sync_producer):
    """One producer and one reader on each node, shared by the module's tests (the producer
    here is the session's)."""
    made = {
        "there": SyncProducer.options(**ON_NODE2).remote(),
        "near": Reader.remote(),
        "far": Reader.options(**ON_NODE2).remote(),
    }
    yield {"here": sync_producer, **made}
    for actor in made.values():
        ray.kill(actor)


def test_auto_uses_shm_on_one_node_and_tcp_across_nodes(actors):
    here, there, reader = actors["here"], actors["there"], actors["near"]
    n = 1 << 15  # above what auto inlines
    refs = [here.value.remote(torch.ones(n)), there.value.remote(torch.full((n,), 2.0)), there.value.remote(torch.ones(3))]
    sums, used, _node = ray.get(reader.read.remote(refs))
    assert sums == [n, 2.0 * n, 3.0]
    assert used == {"shm": 1, "tcp": 1, "inline": 1}


def test_explicit_shm_across_nodes_falls_back_and_says_so(actors):
    there, reader = actors["there"], actors["near"]
    sums, used, _ = ray.get(reader.read.remote([there.value_shm.remote(torch.ones(10))]))
    assert sums == [10.0] and used == {"object_store": 1}


def test_driver_put_is_fetched_across_nodes(actors):
    reader = actors["far"]
    ref = rdt.put(torch.arange(1 << 15, dtype=torch.float64))
    sums, used, node = ray.get(reader.read.remote([ref]))
    assert node != ray.get_runtime_context().get_node_id()  # the reader is on the other node
    assert sums == [float((1 << 15) * ((1 << 15) - 1) // 2)] and used == {"tcp": 1}


@rdt.remote
class FreshProducer:
    @rdt.method(tensor_transport="auto")
    def fresh(self, n: int, value: float):
        return {"w": torch.full((n,), value), "small": torch.arange(5)}

    def segments(self) -> dict:
        from rdt_async.transports import _segments

        return _segments.pool.stats()


def test_auto_on_several_nodes_copies_into_shared_memory_only_for_a_consumer_of_the_node(actors):
    # A fresh tensor is copied into a shared-memory segment for consumers on the producer's
    # node; on a cluster of several nodes that copy waits for the first such consumer to ask
    # (a reader on another node reads the tensor itself over tcp). The producer is fresh
    # (its segment pool's counts are the claim); the readers are the module's, and the driver.
    producer = FreshProducer.remote()
    far, near = actors["far"], actors["near"]
    n = 1 << 19  # 2 MiB
    ref = producer.fresh.remote(n, 3.0)
    created = ray.get(producer.segments.remote())["created"]
    assert ray.get(far.hold.remote([ref])) == ([3.0 * n + 10], {"tcp": 1})
    assert ray.get(producer.segments.remote())["created"] == created  # no copy for it
    assert ray.get(near.hold.remote([ref])) == ([3.0 * n + 10], {"shm": 1})
    before = collections.Counter(rdt.store_stats()["fetches"])
    held = rdt.get(ref)  # the driver, on the producer's node too, is the second near consumer
    assert float(held["w"].sum()) + float(held["small"].sum()) == 3.0 * n + 10
    assert dict(collections.Counter(rdt.store_stats()["fetches"]) - before) == {"shm": 1}
    stats = ray.get(producer.segments.remote())
    assert (stats["created"], stats["used"]) == (created + 1, 1)  # one copy, for both
    del ref
    del held
    ray.get([h.drop.remote() for h in (far, near)])
    wait_until(lambda: ray.get(producer.segments.remote())["used"] == 0, 15)  # recycled
    ray.kill(producer)
