"""Two nodes on one machine: `auto` never picks shared memory across nodes."""

from __future__ import annotations

import collections

import pytest
import ray
import torch
from conftest import ON_NODE2
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
