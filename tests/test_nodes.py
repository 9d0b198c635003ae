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


def test_auto_uses_shm_on_one_node_and_tcp_across_nodes():
    here = SyncProducer.remote()
    there = SyncProducer.options(**ON_NODE2).remote()
    reader = Reader.remote()
    n = 1 << 15  # above what auto inlines
    refs = [here.value.remote(torch.ones(n)), there.value.remote(torch.full((n,), 2.0)), there.value.remote(torch.ones(3))]
    sums, used, _node = ray.get(reader.read.remote(refs))
    assert sums == [n, 2.0 * n, 3.0]
    assert used == {"shm": 1, "tcp": 1, "inline": 1}


def test_explicit_shm_across_nodes_falls_back_and_says_so():
    there = SyncProducer.options(**ON_NODE2).remote()
    reader = Reader.remote()
    sums, used, _ = ray.get(reader.read.remote([there.value_shm.remote(torch.ones(10))]))
    assert sums == [10.0] and used == {"object_store": 1}


def test_driver_put_is_fetched_across_nodes():
    reader = Reader.options(**ON_NODE2).remote()
    ref = rdt.put(torch.arange(1 << 15, dtype=torch.float64))
    sums, used, _ = ray.get(reader.read.remote([ref]))
    assert sums == [float((1 << 15) * ((1 << 15) - 1) // 2)] and used == {"tcp": 1}


@rdt.remote
class FreshProducer:
    @rdt.method(tensor_transport="auto")
    def fresh(self, n: int, value: float):
        return {"w": torch.full((n,), value), "small": torch.arange(5)}

    def segments(self) -> dict:
        from rdt_async.transports import _segments

        return _segments.pool.stats()


@rdt.remote
class Holder:
    async def read(self, refs):
        before = collections.Counter(rdt.store_stats()["fetches"])
        self.values = await rdt.fetch_all(refs)
        used = collections.Counter(rdt.store_stats()["fetches"]) - before
        return [float(v["w"].sum()) + float(v["small"].sum()) for v in self.values], dict(used)

    async def drop(self) -> None:
        self.values = None


def test_auto_on_several_nodes_copies_into_shared_memory_only_for_a_consumer_of_the_node():
    # A fresh tensor is copied into a shared-memory segment for consumers on the producer's
    # node; on a cluster of several nodes that copy waits for the first such consumer to ask
    # (a reader on another node reads the tensor itself over tcp).
    producer = FreshProducer.remote()
    far, near, near2 = Holder.options(**ON_NODE2).remote(), Holder.remote(), Holder.remote()
    n = 1 << 19  # 2 MiB
    ref = producer.fresh.remote(n, 3.0)
    created = ray.get(producer.segments.remote())["created"]
    assert ray.get(far.read.remote([ref])) == ([3.0 * n + 10], {"tcp": 1})
    assert ray.get(producer.segments.remote())["created"] == created  # no copy for it
    assert ray.get(near.read.remote([ref])) == ([3.0 * n + 10], {"shm": 1})
    assert ray.get(near2.read.remote([ref])) == ([3.0 * n + 10], {"shm": 1})
    stats = ray.get(producer.segments.remote())
    assert (stats["created"], stats["used"]) == (created + 1, 1)  # one copy, for both
    del ref
    ray.get([h.drop.remote() for h in (far, near, near2)])
    wait_until(lambda: ray.get(producer.segments.remote())["used"] == 0, 15)  # recycled
    for actor in (producer, far, near, near2):
        ray.kill(actor)
