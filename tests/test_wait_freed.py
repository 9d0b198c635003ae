"""wait_tensor_freed is exact: a producer that waits, then writes in place, never tears a read.

The store's holds are checked on their own (no Ray), then raced on real actors: a trainer
publishes version v of its weights and at once trains v+1 in place after waiting, while a
consumer loads v — over every transport this machine has, in async, threaded and sync
producers. Every value a consumer sees must be exactly the version published.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time

import numpy
import pytest
import torch

from rdt_async._store import Store, StoredObject

# -- the store's holds, without Ray ----------------------------------------------------------


def held(store: Store, tensor: torch.Tensor) -> bool:
    return not store.wait_freed_blocking(tensor, 0)


def test_an_object_holds_its_bytes_under_any_view():
    s, base = Store(), torch.zeros(100)
    s.add("a", StoredObject([base[10:20]]))
    assert held(s, base)  # the base covers the held slice
    assert held(s, base[15:16])
    assert held(s, base.view(10, 10)[1])  # another tensor object over the same bytes
    assert not held(s, base[20:30]) and not held(s, base[:10])  # disjoint bytes are free
    assert not held(s, torch.zeros(100))
    s.free("a")
    assert not held(s, base)


def test_storages_over_the_same_memory_at_other_addresses_hold_each_others_bytes():
    # Two storages over one array, starting at different addresses (torch.from_numpy of
    # slices; frombuffer(offset=), DLPack likewise): a hold on either covers the other.
    array = numpy.zeros(3 << 20, dtype=numpy.float32)  # 12 MiB: spans cross 4 MiB chunks
    whole, part = torch.from_numpy(array), torch.from_numpy(array[(1 << 20) + 5:(2 << 20) + 7])
    assert whole.untyped_storage().data_ptr() != part.untyped_storage().data_ptr()
    s = Store()
    s.add("a", StoredObject([whole[-3:]]))  # the last 3 floats only
    assert not held(s, part) and held(s, torch.from_numpy(array[-1:]))
    s.free("a")
    s.add("b", StoredObject([part]))
    assert held(s, whole) and held(s, whole[(2 << 20) + 6:]) and held(s, torch.from_numpy(array[(1 << 20) + 5:][:1]))
    assert not held(s, whole[(2 << 20) + 7:]) and not held(s, whole[:(1 << 20) + 5])
    later = torch.frombuffer(memoryview(array).cast("B"), dtype=torch.uint8, offset=(2 << 22) - 4, count=8)
    assert held(s, later)  # a uint8 view over the bytes around `part`'s 4 MiB boundary
    assert s.holder([whole[:8], whole]) == (1, "b")
    s.free("b")
    assert not held(s, whole)


def test_a_strided_view_holds_the_span_it_reaches():
    s, base = Store(), torch.zeros(10, 10)
    s.add("a", StoredObject([base[:, 3]]))  # elements 3, 13, ..., 93
    assert held(s, base[9, 3:4]) and held(s, base[5])
    assert not held(s, base[9, 4:]) and not held(s, base[0, :3])


def test_holding_covers_an_object_being_made_and_a_read():
    s, t = Store(), torch.zeros(4)
    with s.holding([t]):
        assert held(s, t)
    assert not held(s, t)
    s.add("a", StoredObject([t]))
    with s.reading("a") as stored:
        assert stored is not None and stored.tensors[0] is t
        s.free("a")  # freed while a send reads it: still held until the read ends
        assert held(s, t)
    assert not held(s, t)
    with s.reading("a") as stored:
        assert stored is None


def test_an_object_made_while_a_waiter_waits_keeps_it_waiting_until_made():
    s, t = Store(), torch.zeros(4)
    s.add("a", StoredObject([t]))

    async def main() -> None:
        waiter = asyncio.ensure_future(s.wait_freed(t[2:3]))
        await asyncio.sleep(0.01)
        with s.holding([t[2:]]):  # a return of the same bytes begins while the waiter waits for "a"
            s.free("a")
            await asyncio.sleep(0.05)
            assert not waiter.done()  # still held, by the object being made
        await asyncio.wait_for(waiter, 5)

    asyncio.run(main())
    assert not s._waiters and not s._held and not s._unseen and not s._seen
    with s.holding([t]):  # made with nobody looking: its bytes are not worked out
        assert s._unseen and not s._held
    assert not s._unseen and not held(s, t)


def test_an_object_kept_with_nobody_looking_works_out_its_bytes_only_when_a_waiter_looks():
    s, t = Store(), torch.zeros(4)
    kept = StoredObject([t[1:3]])
    s.add("a", kept)
    assert kept.spans is None and not s._held  # kept, its bytes not worked out
    s.free("a")
    assert kept.spans is None and not s._held and not s._unseen_objects  # freed as it was: nothing to release
    s.add("b", StoredObject([t[1:3]]))
    assert held(s, t) and s._held and not s._unseen_objects  # a waiter looked: held as any
    s.free("b")
    assert not held(s, t) and not s._held


def test_an_object_nobody_waited_on_stays_held_until_its_transports_let_go():
    """Freed with nobody looking yet, an object was let go before its transports released
    it (cuda_ipc and nixl clear their liveness slot there): a waiter arriving in between
    returned, and its write could land under a consumer's read the slot had not yet
    stopped."""
    from rdt_async.transports._base import Transport

    entered, go = threading.Event(), threading.Event()

    class Releasing(Transport):  # its garbage_collect takes a while
        name = "releasing"

        async def receive(self, info, buffers, channel):
            raise AssertionError("not fetched here")

        def garbage_collect(self, obj_id, meta):
            entered.set()
            go.wait(10)

    s, w = Store(), torch.zeros(1 << 10)
    s.add("o", StoredObject([w], {Releasing(): None}))
    freeing = threading.Thread(target=s.free, args=("o",))
    freeing.start()
    try:
        assert entered.wait(10)
        assert not s.wait_freed_blocking(w, 0.2)  # held while its transports let go
    finally:
        go.set()
        freeing.join(10)
    assert s.wait_freed_blocking(w, 5) and not s._held and not s._unseen_objects


def test_waiters_wake_when_the_last_hold_goes_and_only_then():
    s, t = Store(), torch.zeros(4)
    s.add("a", StoredObject([t]))
    s.add("b", StoredObject([t[1:2]]))

    async def main() -> list[str]:
        seen = []
        waiter = asyncio.ensure_future(s.wait_freed(t))
        await asyncio.sleep(0.01)
        s.free("a")
        await asyncio.sleep(0.01)
        seen.append("waiting" if not waiter.done() else "woken")
        s.free("b")
        await asyncio.wait_for(waiter, 5)
        seen.append("woken")
        return seen

    assert asyncio.run(main()) == ["waiting", "woken"]
    assert not s._waiters


def test_a_cancelled_or_timed_out_wait_leaves_no_waiter():
    s, t = Store(), torch.zeros(4)
    s.add("a", StoredObject([t]))

    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await s.wait_freed(t)

    asyncio.run(main())
    assert not s.wait_freed_blocking(t, 0.05)
    assert not s._waiters


def test_the_blocking_wait_wakes_from_another_thread():
    s, t = Store(), torch.zeros(4)
    s.add("a", StoredObject([t]))
    threading.Timer(0.1, s.free, args=("a",)).start()
    started = time.monotonic()
    assert s.wait_freed_blocking(t, 10)
    assert 0.05 < time.monotonic() - started < 5


# -- the race on real actors -----------------------------------------------------------------

N = 1 << 22  # 16 MiB of float32: an export long enough to race a fill_
VERSIONS = 6


def _transports() -> list:
    out = ["auto", "shm", "object_store", "gloo"]
    out.append(
        "nixl" if importlib.util.find_spec("nixl") else pytest.param("nixl", marks=pytest.mark.skip("nixl not installed"))
    )
    return out


def _trainers():
    import rdt_async as rdt

    class Weights:
        def __init__(self) -> None:
            self.w = torch.zeros(N)

        def version(self, v: int) -> None:
            self.w.fill_(float(v))  # in place, as an optimizer step

    # One class a kind for every transport: each publish picks its own,
    # publish.options(tensor_transport=...).

    @rdt.remote
    class AsyncTrainer(Weights):
        @rdt.method
        async def publish(self):
            return {"w": self.w}

        async def train(self, v: int) -> None:
            await rdt.wait_tensor_freed(self.w)
            self.version(v)

    @rdt.remote(max_concurrency=4)
    class ThreadedTrainer(Weights):
        @rdt.method
        def publish(self):
            return {"w": self.w}

        def train(self, v: int) -> None:
            rdt.wait_tensor_freed_sync(self.w, timeout=60)
            self.version(v)

    @rdt.remote  # one method at a time: train runs after publish has returned
    class SyncTrainer(Weights):
        @rdt.method
        def publish(self):
            return {"w": self.w}

        def train(self, v: int) -> None:
            rdt.wait_tensor_freed_sync(self.w, timeout=60)
            self.version(v)

    @rdt.remote
    class Loader:
        async def load(self, weights) -> tuple[float, float]:
            w = weights["w"]
            return float(w.min()), float(w.max())

    return {"async": AsyncTrainer, "threaded": ThreadedTrainer, "sync": SyncTrainer}, Loader


@pytest.fixture(scope="module")
def actors(cluster):
    """One trainer a kind and one loader, shared by every transport (nothing here kills them)."""
    import ray

    classes, Loader = _trainers()
    trainers, loader = {kind: cls.remote() for kind, cls in classes.items()}, Loader.remote()
    yield trainers, loader
    for actor in [*trainers.values(), loader]:
        ray.kill(actor)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("kind", ["async", "threaded", "sync"])
@pytest.mark.parametrize("transport", _transports())
def test_publish_then_train_in_place_never_tears_a_read(transport, kind, actors):
    import ray

    import rdt_async as rdt

    trainers, loader = actors
    trainer = trainers[kind]
    ray.get(trainer.train.remote(0), timeout=60)  # version 0 again: the last test's loads are done
    group = rdt.create_collective_group([trainer, loader], backend="gloo") if transport == "gloo" else None
    try:
        loads = []
        for v in range(VERSIONS):
            ref = trainer.publish.options(tensor_transport=transport).remote()
            if kind == "threaded":  # its calls run at once in any order: train only after the return
                ray.wait([ref], timeout=60)
            loads.append(loader.load.remote(ref))
            del ref  # the load is the last holder
            ray.get(trainer.train.remote(v + 1), timeout=60)  # waits for the load, then writes v + 1
        seen = ray.get(loads, timeout=120)
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
    torn = [(v, lo, hi) for v, (lo, hi) in enumerate(seen) if lo != hi]
    assert not torn, f"torn reads over {transport} (version, min, max): {torn}"
    versions = [int(lo) for lo, _ in seen]
    if kind == "async":
        # Ray may start train(v + 1) before publish(v) on an async actor (no order among its
        # calls): then v + 1 is what was published. Never later: train(v + 2) waits for this load.
        assert all(s in (v, v + 1) for v, s in enumerate(versions)), versions
    else:
        assert versions == list(range(VERSIONS))  # each load: the version published


def test_the_sync_twin_refuses_a_loop_thread_a_non_tensor_and_times_out():
    import rdt_async as rdt
    from rdt_async._api import store

    t = torch.zeros(4)

    async def on_a_loop() -> None:
        rdt.wait_tensor_freed_sync(t)

    with pytest.raises(RuntimeError, match=re.escape("await rdt.wait_tensor_freed")):
        asyncio.run(on_a_loop())
    with pytest.raises(TypeError, match="wait_tensor_freed_sync"):
        rdt.wait_tensor_freed_sync([t])  # type: ignore[arg-type]
    with store.holding([t]):
        with pytest.raises(TimeoutError, match=re.escape("still held after 0.05 s")):
            rdt.wait_tensor_freed_sync(t, timeout=0.05)
    rdt.wait_tensor_freed_sync(t, timeout=0.05)  # nothing holds it now
