"""Lifetime: the producer frees tensors when the last ref and copy are gone.

The producers and consumers are shared by the module's tests (each test leaves its
producer's store empty and its segments unlinked); a test that kills an actor makes its own.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from conftest import rdt_segments, wait_until
from helpers import SyncProducer

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")


def objects_of(producer) -> int:
    return ray.get(producer.stats.remote())["objects"]


def segments_of(pid: int) -> set[str]:
    return {s for s in rdt_segments() if s.startswith(f"rdt-{pid}-")}


@pytest.fixture
def producer(sync_producer):
    """The session's shared producer, found and left clean: nothing in its store, no segment of its."""
    p, pid = sync_producer, ray.get(sync_producer.pid.remote())
    clean = lambda: objects_of(p) == 0 and not segments_of(pid)  # noqa: E731
    wait_until(clean, 10, lambda: "the shared producer came with objects of another test")
    yield p
    wait_until(clean, 10, lambda: "the shared producer keeps objects")


@pytest.fixture
def consumer(async_consumer):
    return async_consumer


def test_store_goes_back_to_zero_when_refs_are_dropped(producer, consumer):
    pid = ray.get(producer.pid.remote())
    refs = [producer.make.remote(1 << 15, seed=i) for i in range(5)]
    ray.wait(refs, num_returns=5)
    assert ray.get(producer.stats.remote())["bytes"] == 5 * 4 * (1 << 15)
    # On a cluster of several nodes (this session's) auto copies an object into shared
    # memory at the first fetch from the producer's node.
    assert not segments_of(pid)
    values = ray.get(consumer.fetch_all.remote(refs))
    assert [v["step"] for v in values] == list(range(5))
    assert len(segments_of(pid)) == 5
    del refs
    wait_until(lambda: objects_of(producer) == 0, 10)
    wait_until(lambda: not segments_of(pid), 10)


def test_ref_passed_as_argument_and_dropped_at_once(producer, consumer):
    out = consumer.checksums.remote(producer.value.remote(torch.ones(100)))
    assert ray.get(out) == [100.0]
    wait_until(lambda: objects_of(producer) == 0, 10)


KEPT = 1 << 15  # 128 KiB of float32: over what auto inlines (an inline object keeps nothing)


def test_deserialized_copy_keeps_the_object_alive(producer):
    ref = producer.value.remote(torch.ones(KEPT))
    obj = ray.get(ref)
    del ref
    assert objects_of(producer) == 1
    assert rdt.get(obj).sum().item() == KEPT
    del obj
    wait_until(lambda: objects_of(producer) == 0, 10)


def test_objects_held_by_a_killed_actor_are_freed(producer):
    @rdt.remote
    class Holder:
        def hold(self, refs):
            self.refs = refs

    holder = Holder.remote()
    ray.get(holder.hold.remote([producer.value.remote(torch.ones(KEPT))]))
    assert objects_of(producer) == 1
    ray.kill(holder)
    wait_until(lambda: objects_of(producer) == 0, 20)


def test_free_releases_now_and_later_fetches_fail(producer, consumer):
    pid = ray.get(producer.pid.remote())
    ref = producer.value.remote(torch.ones(1 << 15))
    rdt.free(ref)
    with pytest.raises(rdt.ObjectFreedError):
        rdt.get(ref)
    wait_until(lambda: objects_of(producer) == 0 and not segments_of(pid), 10)
    with pytest.raises(rdt.ObjectFreedError, match="freed"):
        ray.get(consumer.take.remote(ref))


@rdt.remote
class Keeper:
    """An async actor that keeps a tensor, makes many tiny objects, and frees what it did not make."""

    def __init__(self):
        self.t = torch.ones(KEPT)
        self.small = torch.zeros(16)

    @rdt.method
    async def publish_small(self):
        self.small = torch.zeros(16)
        return self.small

    async def write_then_fetch_back(self, refs):
        async with asyncio.timeout(5):
            await rdt.wait_tensor_freed(self.small)  # at once, though the ref lives
        self.small.fill_(7.0)
        return (await rdt.fetch(refs[0])) is self.small, rdt.store_stats()["objects"]

    async def share(self):
        return [rdt.put({"t": self.t})]

    async def wait_freed(self, seconds):
        try:
            async with asyncio.timeout(seconds):
                await rdt.wait_tensor_freed(self.t)
        except TimeoutError:
            return "still held"
        return "freed"

    @rdt.method(tensor_transport="object_store")  # kept here until fetched (inline keeps nothing)
    async def tiny(self, i: int):
        return torch.full((4,), float(i))

    async def anchors_from_own_method(self) -> bool:
        from rdt_async import _object

        return _object._anchor_source() is not None

    async def stats(self):
        return rdt.store_stats()

    async def free_then_fetch(self, refs):
        try:
            rdt.free(await refs[0])  # (a ref itself is refused on a loop: resolving it would block)
        except rdt.RDTError as exc:
            refused = str(exc)
        return refused, float((await rdt.fetch(refs[0]))["x"].sum())


@pytest.fixture(scope="module")
def keeper(cluster):
    k = Keeper.remote()
    yield k
    ray.kill(k)


def test_free_on_the_producer_and_wait_tensor_freed(keeper):
    [ref] = ray.get(keeper.share.remote())
    assert ray.get(keeper.wait_freed.remote(0.3)) == "still held"
    waiting = keeper.wait_freed.remote(30)
    del ref
    assert ray.get(waiting) == "freed"


def test_small_objects_keep_nothing_in_the_producer(keeper):
    # Their bytes ride in the ref, a snapshot taken at return: no store entry, no anchor,
    # nothing for wait_tensor_freed to wait for; the producer's own fetch still gets its tensor.
    before = objects_of(keeper)
    ref = keeper.publish_small.remote()
    same, held = ray.get(keeper.write_then_fetch_back.remote([ref]))
    assert same and held == before
    assert rdt.get(ref).sum().item() == 0.0  # elsewhere: the snapshot, not the later write
    rdt.free(ref)
    with pytest.raises(rdt.ObjectFreedError):
        rdt.get(ref)


def test_shared_memory_of_a_killed_producer_is_unlinked():
    p = SyncProducer.remote()
    pid = ray.get(p.pid.remote())
    ref = p.value_shm.remote(torch.ones(1 << 17))  # 512 KiB: copied into a segment (not a shared storage)
    ray.wait([ref])
    assert len(segments_of(pid)) == 1
    ray.kill(p)
    wait_until(lambda: not segments_of(pid), 10, lambda: f"{segments_of(pid)} left after kill")
    with pytest.raises(rdt.RDTError):
        rdt.get(ref, timeout=30)


def test_segments_are_private_and_unguessable(producer):
    pid = ray.get(producer.pid.remote())
    ref = producer.value_shm.remote(torch.ones(1 << 15))
    ray.wait([ref])
    [seg] = segments_of(pid)
    assert os.stat(f"/dev/shm/{seg}").st_mode & 0o777 == 0o600
    assert len(seg.rsplit("-", 1)[1]) == 24  # 96 random bits
    del ref


def test_anchors_from_the_actors_own_method_keep_lifetime_exact(keeper):
    # Past the first few objects, an rdt actor's anchors are the returns of calls to its
    # own rdt__anchors method (no plasma put each); each still frees exactly its object.
    p = keeper
    assert ray.get(p.stats.remote())["objects"] == 0
    refs = [p.tiny.remote(i) for i in range(100)]
    values = [rdt.get(r, timeout=60) for r in refs]
    assert [float(v[0]) for v in values] == [float(i) for i in range(100)]
    assert ray.get(p.anchors_from_own_method.remote())
    from rdt_async import _object

    assert _object._anchor_source() is None  # the driver puts its anchors
    assert ray.get(p.stats.remote())["objects"] == 100
    del refs[::2]
    wait_until(lambda: ray.get(p.stats.remote())["objects"] == 50, 10)
    assert [float(rdt.get(r, timeout=60)[0]) for r in refs] == [float(i) for i in range(1, 100, 2)]
    del refs
    wait_until(lambda: ray.get(p.stats.remote())["objects"] == 0, 10)


def test_a_free_refused_in_the_wrong_process_frees_nothing_there(keeper):
    ref = rdt.put({"x": torch.ones(1 << 15)}, tensor_transport="shm")
    refused, total = ray.get(keeper.free_then_fetch.remote([ref]))
    assert "call rdt.free() there" in refused and total == float(1 << 15)
    rdt.free(ref)
    with pytest.raises(rdt.ObjectFreedError):
        rdt.get(ref)


def test_a_return_whose_anchor_cannot_be_made_keeps_nothing(monkeypatch):
    """The anchor (an ObjectRef whose going frees the object) is made last: if that fails
    (Ray shutting down), the object is freed there and then, its segment with it."""
    from rdt_async import _object
    from rdt_async._api import store

    def no_anchor(obj_id):
        raise RuntimeError("Ray is shutting down")

    monkeypatch.setattr(_object._anchors, "take", no_anchor)
    held = set(store.object_ids())
    segments = rdt_segments()
    with pytest.raises(RuntimeError, match="Ray is shutting down"):
        rdt.put({"w": torch.ones(1 << 20)}, tensor_transport="shm")  # 4 MiB: a segment
    assert set(store.object_ids()) == held
    assert rdt_segments() <= segments
