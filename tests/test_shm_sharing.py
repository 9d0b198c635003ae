"""shm's shared storages: a tensor the producer shared once is exported without a copy.

The user puts it in shared memory (`share_memory_()`, as the docs say; rdt_async never
moves a storage itself); consumers map the producer's memory copy-on-write; a consumer's
view holds the object, so `wait_tensor_freed` in the producer waits until every
consumer has dropped what it fetched, an explicit `rdt.free` included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
import ray
import torch
from conftest import wait_until

import rdt_async as rdt
from rdt_async.transports._base import TensorSpec, TransferInfo
from rdt_async.transports.shm import (
    SHARE_MIN_BYTES,
    ShmMeta,
    _close_lent,
    _lend,
    _map_shared,
    _shared,
    _views,
)

N = 1 << 20  # float32 elements: 4 MiB, over SHARE_MIN_BYTES


@rdt.remote
class Trainer:
    def __init__(self, share: bool = True) -> None:
        self.w = torch.arange(N, dtype=torch.float32)
        if share:
            self.w.share_memory_()  # once, at creation: every export then copies nothing

    @rdt.method(tensor_transport="shm")
    def publish(self):
        return {"w": self.w, "slice": self.w[100:200], "col": self.w.view(1024, 1024)[:, 3]}

    def where(self) -> tuple[int, bool]:
        return self.w.untyped_storage().data_ptr(), self.w.untyped_storage().is_shared()

    async def wait_freed(self, seconds: float) -> str:
        try:
            async with asyncio.timeout(seconds):
                await rdt.wait_tensor_freed(self.w)
        except TimeoutError:
            return "held"
        return "free"

    async def step(self, v: float) -> None:
        await rdt.wait_tensor_freed(self.w)
        self.w.fill_(v)

    def total(self) -> float:
        return float(self.w.double().sum())

    def held(self) -> dict:
        return rdt.store_stats()

    def overwrite(self, v: float) -> None:
        self.w.fill_(v)  # without waiting: what a consumer holds shows whether it was copied

    async def reset(self) -> dict:
        """Once no view of it is left, put back the first version of its weights (in place)."""
        async with asyncio.timeout(10):
            await rdt.wait_tensor_freed(self.w)
        self.w.copy_(torch.arange(N, dtype=torch.float32))
        return rdt.store_stats()

    @rdt.method(tensor_transport="shm")
    def make(self, v: float):
        return {"w": torch.full((N // 2,), v)}  # 2 MiB, fresh each call: copied into a warm segment

    def segments_made(self) -> int:
        from rdt_async.transports import _segments

        return _segments.pool.stats()["created"]


@rdt.remote
class Reader:
    async def keep(self, value) -> float:
        self.kept = value  # views of the trainer's memory
        return float(value["w"].double().sum())

    async def total(self, value) -> float:
        return float(value["w"].double().sum())

    async def kept_total(self) -> float:
        return float(self.kept["w"].double().sum())

    async def drop(self) -> None:
        del self.kept

    async def forget(self) -> bool:
        """Drop whatever a test left kept; say whether there was something."""
        return self.__dict__.pop("kept", None) is not None

    async def scribble(self, value) -> float:
        value["w"].fill_(-1.0)  # its own copy-on-write pages
        return float(value["w"][0])

    async def check(self, value) -> dict:
        return {
            "w": float(value["w"].double().sum()),
            "slice": value["slice"].tolist() == list(range(100, 200)) or value["slice"].tolist(),
            "col": value["col"].tolist() == [float(3 + 1024 * i) for i in range(1024)] or "wrong",
        }

    async def maps(self) -> dict:
        """This consumer's kept mappings (transports/_mappings.py)."""
        import gc

        from rdt_async.transports import _mappings

        gc.collect()  # views in a collected cycle let their mapping go now, not at some later GC
        return _mappings.cache.stats()

    async def into(self, refs) -> bool:
        obj = await refs[0]
        w, col = torch.empty(N), torch.empty(1024 * 2)[::2]  # contiguous, and strided
        out = await rdt.fetch(obj, into={"w": w, "slice": torch.empty(100), "col": col})
        return torch.equal(out["w"], torch.arange(N, dtype=torch.float32)) and torch.equal(
            col, torch.arange(3, N, 1024, dtype=torch.float32)
        )


pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def shared_actors():
    """One trainer (its weights shared once) and two readers for the module's tests."""
    t, r1, r2 = Trainer.remote(), Reader.remote(), Reader.remote()
    yield t, r1, r2
    for a in (t, r1, r2):
        ray.kill(a)


@pytest.fixture
def actors(shared_actors, ray_session):
    """The shared actors; after the test, no view of the trainer's weights is left, and it
    holds no object and has its first version back (a test that stepped it)."""
    t, r1, r2 = shared_actors
    yield shared_actors
    ray.get([r1.forget.remote(), r2.forget.remote()])
    wait_until(lambda: ray.get(t.held.remote())["objects"] == 0, 10, lambda: ray.get(t.held.remote()))
    assert ray.get(t.reset.remote())["lent"] == 0
    assert ray.get(t.total.remote()) == float(N * (N - 1) // 2)


def test_a_tensor_shared_once_exports_without_a_copy_and_arrives_exact(actors):
    t, r, _ = actors
    ptr, shared = ray.get(t.where.remote())
    assert shared
    for _ in range(3):
        ref = t.publish.remote()
        assert ray.get(r.check.remote(ref)) == {"w": float(N * (N - 1) // 2), "slice": True, "col": True}
        assert ray.get(t.where.remote()) == (ptr, True)  # the same memory: nothing copied, nothing moved
    assert ray.get(r.into.remote([t.publish.remote()]))  # into=: read, not mapped


def test_a_kept_tensor_not_shared_is_copied_at_each_return_and_never_moved(actors):
    # Moving a storage frees its old memory under anyone still reading it (another thread,
    # a send): rdt_async leaves that to the user, and copies instead.
    t, (_, r, _) = Trainer.remote(share=False), actors
    try:
        ptr, shared = ray.get(t.where.remote())
        assert not shared
        kept = t.publish.remote()
        assert ray.get(r.keep.remote(kept)) == float(N * (N - 1) // 2)
        for _ in range(3):
            assert ray.get(r.check.remote(t.publish.remote())) == {"w": float(N * (N - 1) // 2), "slice": True, "col": True}
        assert ray.get(t.where.remote()) == (ptr, False)
        ray.get(t.overwrite.remote(3.0))
        assert ray.get(r.kept_total.remote()) == float(N * (N - 1) // 2)  # a snapshot
        assert ray.get(r.check.remote(t.publish.remote()))["w"] == 3.0 * N
    finally:
        ray.kill(t)


def test_an_explicit_free_refuses_later_fetches_and_still_waits_for_the_views_out_there(actors):
    t, keeper, late = actors
    ref = t.publish.remote()
    assert ray.get(keeper.keep.remote(ref)) == float(N * (N - 1) // 2)  # a view of the trainer's memory
    rdt.free(ref)  # from the driver: the producer frees it (fire and forget)
    wait_until(lambda: ray.get(t.held.remote())["lent"] == 1, 10)
    with pytest.raises(rdt.ObjectFreedError, match="freed"):
        ray.get(late.total.remote(ref))  # its descriptor is closed: no map of live memory
    del ref
    assert ray.get(t.wait_freed.remote(0.5)) == "held"  # the keeper still views version 0
    stepping = t.step.remote(5.0)
    assert ray.get(keeper.kept_total.remote()) == float(N * (N - 1) // 2)  # unchanged meanwhile
    ray.get(keeper.drop.remote())
    ray.get(stepping, timeout=30)  # the step ran once the view (the last ref) was gone
    assert ray.get(t.held.remote())["lent"] == 0
    assert ray.get(late.check.remote(t.publish.remote()))["w"] == 5.0 * N


def test_wait_tensor_freed_waits_for_every_consumer_view_and_writes_reach_only_new_fetches(actors):
    t, r, _ = actors
    ref = t.publish.remote()
    assert ray.get(r.keep.remote(ref)) == float(N * (N - 1) // 2)
    del ref
    assert ray.get(t.wait_freed.remote(0.5)) == "held"  # the reader still views version 0
    stepping = t.step.remote(1.0)
    assert ray.get(r.kept_total.remote()) == float(N * (N - 1) // 2)  # unchanged meanwhile
    ray.get(r.drop.remote())
    ray.get(stepping, timeout=60)  # the step ran once the view was gone
    assert ray.get(r.check.remote(t.publish.remote()))["w"] == float(N)  # the new version
    assert ray.get(t.wait_freed.remote(10)) == "free"


def test_a_consumer_writing_its_view_changes_nothing_for_the_producer_or_others(actors):
    t, r1, r2 = actors
    ref = t.publish.remote()
    assert ray.get(r1.scribble.remote(ref)) == -1.0
    assert ray.get(r2.check.remote(ref))["w"] == float(N * (N - 1) // 2)
    assert ray.get(t.total.remote()) == float(N * (N - 1) // 2)


def test_a_consumer_maps_a_file_again_through_its_kept_mapping_and_sees_only_the_file(actors):
    # The second fetch of the same storage reuses the reader's warm mapping; what the
    # reader wrote through the first is dropped first, what the producer wrote shows.
    t, r, _ = actors
    whole = float(N * (N - 1) // 2)
    wait_until(lambda: ray.get(r.maps.remote())["idle"] == 0, 10)  # no warm mapping of the tests before
    before = ray.get(r.maps.remote())  # (its counts so far)
    assert ray.get(r.check.remote(t.publish.remote()))["w"] == whole
    assert ray.get(r.scribble.remote(t.publish.remote())) == -1.0  # 4 MiB of private pages
    assert ray.get(r.check.remote(t.publish.remote())) == {"w": whole, "slice": True, "col": True}
    ray.get(t.step.remote(2.0))  # in place, once no view is left
    assert ray.get(r.check.remote(t.publish.remote()))["w"] == 2.0 * N
    maps = ray.get(r.maps.remote())
    restored = maps["restored_pages"] - before["restored_pages"]
    assert maps["reused"] - before["reused"] >= 2 and restored == N * 4 // os.sysconf("SC_PAGE_SIZE")
    assert ray.get(t.total.remote()) == 2.0 * N  # the reader's writes never reached it
    wait_until(lambda: ray.get(r.maps.remote())["idle"] == 0, 10)  # idle for RDT_SHM_IDLE_S (1 s here)


def test_two_fetches_alive_at_once_never_share_a_mapping(actors):
    t, r, _ = actors
    first = t.publish.remote()
    assert ray.get(r.keep.remote(first)) == float(N * (N - 1) // 2)  # kept: its mapping is busy
    assert ray.get(r.scribble.remote(t.publish.remote())) == -1.0  # another mapping
    assert ray.get(r.kept_total.remote()) == float(N * (N - 1) // 2)  # untouched by the scribble
    ray.get(r.drop.remote())


def test_a_descriptor_that_names_another_file_now_is_refused():
    # The producer's fd number is checked against the storage's inode: a stale one
    # (the object freed, the number reused) must never map someone else's bytes.
    w = torch.ones(SHARE_MIN_BYTES // 4).share_memory_()
    (good,) = _lend("x", [w], [_shared(w)])  # as `prepare` lends it
    assert good is not None
    try:
        info = TransferInfo("x", (TensorSpec.of(w),), ShmMeta(None, 0, (0,), (good,)), producer_pid=os.getpid())
        lent = _views(info.specs, (good,))  # (what `_map` finds in the ref)
        mapping = _map_shared(info, good, lent)
        assert float(torch.frombuffer(mapping, dtype=torch.float32, count=w.numel()).sum()) == w.numel()
        del mapping
        with pytest.raises(rdt.ObjectFreedError, match="freed"):
            _map_shared(info, dataclasses.replace(good, inode=(good.inode[0], good.inode[1] + 1)), lent)
    finally:
        _close_lent(ShmMeta(None, 0, (0,), (good,)))


def test_fresh_tensors_reuse_warm_segments_never_under_a_view(actors):
    p, keeper, reader = actors  # the trainer makes fresh tensors too
    made, before = ray.get(p.segments_made.remote()), ray.get(reader.maps.remote())
    assert ray.get(keeper.keep.remote(p.make.remote(7.0))) == 7.0 * N // 2  # a view kept
    explicit = p.make.remote(9.0)
    assert ray.get(reader.keep.remote(explicit)) == 9.0 * N // 2
    rdt.free(explicit)  # freed under the reader's view: that segment is never reused
    for v in range(1, 9):
        assert ray.get(reader.total.remote(p.make.remote(float(v)))) == v * N // 2
    assert ray.get(p.segments_made.remote()) - made <= 4  # 10 objects: warm segments recycled
    assert ray.get(reader.scribble.remote(p.make.remote(5.0))) == -1.0
    for v in range(1, 5):  # through the reader's kept mappings of recycled segments
        assert ray.get(reader.total.remote(p.make.remote(float(v)))) == v * N // 2
    assert ray.get(reader.maps.remote())["reused"] - before["reused"] >= 4
    assert ray.get(keeper.kept_total.remote()) == 7.0 * N // 2  # never overwritten
    assert ray.get(reader.kept_total.remote()) == 9.0 * N // 2


# -- a /dev/shm with no room (a container's 64 MiB default) ---------------------------------


@pytest.fixture
def small_shm(tmp_path):
    """A 8 MiB tmpfs, as a container's small /dev/shm (root only: it mounts one)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    where = tmp_path / "shm"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@rdt.remote
class Cramped:
    """A producer whose segments go to a small tmpfs (its /dev/shm, as it were)."""

    def __init__(self, shm_dir: str) -> None:
        from rdt_async.transports import _segments

        _segments.SHM_DIR = shm_dir

    @rdt.method
    def fresh(self, n: int):
        return {"w": torch.arange(n, dtype=torch.float32)}

    @rdt.method(tensor_transport="shm")
    def fresh_shm(self, n: int):
        return {"w": torch.arange(n, dtype=torch.float32)}

    def alive(self) -> int:
        return os.getpid()


def test_no_room_in_dev_shm_is_an_error_naming_the_fix_and_auto_takes_the_object_store(small_shm, actors):
    n = 4 << 20  # 16 MiB of float32, twice the tmpfs
    producer, (_, reader, _) = Cramped.remote(small_shm), actors
    pid = ray.get(producer.alive.remote())
    try:
        # auto: a copy into a segment would not fit; the bytes go another way, exact
        assert ray.get(reader.total.remote(producer.fresh.remote(n))) == float(n * (n - 1) // 2)
        # shm asked for by name: the return fails with what to do, the producer lives on
        with pytest.raises(rdt.TransportUnavailableError, match=r"has no room for 16\.0 MiB .*--shm-size"):
            ray.get(reader.total.remote(producer.fresh_shm.remote(n)))
        assert ray.get(producer.alive.remote()) == pid
        assert os.listdir(small_shm) == []  # no segment left half made
        assert ray.get(reader.total.remote(producer.fresh.remote(n))) == float(n * (n - 1) // 2)  # and again
    finally:
        ray.kill(producer)


def test_a_lazy_export_racing_its_objects_free_leaves_no_segment(monkeypatch):
    """auto on several nodes copies into shared memory at the first fetch of the node; a
    free that lands while that copy runs must not leave the segment behind."""
    from rdt_async import ObjectFreedError
    from rdt_async.transports import _segments, shm

    t = shm.ShmTransport()
    x = torch.arange(N // 2, dtype=torch.float32)  # 2 MiB, not in shared memory
    made: list[str] = []
    take = _segments.pool.take

    def take_then_free(nbytes: int, name: str) -> _segments.Segment:
        seg = take(nbytes, name)
        made.append(seg.path)
        t.garbage_collect("racing", meta)  # the free, while the export copies
        return seg

    meta = t.prepare_lazily("racing", [x])
    assert meta.lazy and meta.segment is None
    monkeypatch.setattr(_segments.pool, "take", take_then_free)
    with pytest.raises(ObjectFreedError, match="freed while it was fetched"):
        t._export("racing", [x], meta)
    assert len(made) == 1 and not os.path.exists(made[0])
    monkeypatch.setattr(_segments.pool, "take", take)

    # Freed before the first fetch: no segment is made at all.
    meta = t.prepare_lazily("early", [x])
    t.garbage_collect("early", meta)
    with pytest.raises(ObjectFreedError, match="freed before it was fetched"):
        t._export("early", [x], meta)

    # The usual course: made once for every fetch, released at the free.
    meta = t.prepare_lazily("kept", [x])
    first, again = t._export("kept", [x], meta), t._export("kept", [x], meta)
    assert first == again and first.segment is not None
    path = os.path.join(_segments.SHM_DIR, first.segment)
    got = torch.frombuffer(bytearray(open(path, "rb").read(x.nbytes)), dtype=torch.float32)
    assert torch.equal(got, x)
    t.garbage_collect("kept", meta)
    assert not os.path.exists(path) and not shm._lazy


def test_a_split_read_that_fails_returns_only_once_its_other_half_has_stopped(monkeypatch):
    """Large reads go in two halves at once; the caller closes the file and may reuse the
    buffer once the read returns, so a failing half must wait for the other."""
    import time

    from rdt_async.transports import shm

    finished = []

    def pread_range(fd, view, offset, start, end):
        if start == 0:
            raise OSError("short read of a shared memory segment")
        time.sleep(0.3)
        finished.append(end)

    monkeypatch.setattr(shm, "_pread_range", pread_range)
    t = torch.empty(shm.SPLIT_READ_BYTES, dtype=torch.uint8)
    with pytest.raises(OSError, match="short read"):
        shm._pread_exact(-1, t, 0, t.numel())
    assert finished == [t.numel()]


def test_a_guardian_sweeps_only_files_of_its_own_pid_namespace(tmp_path):
    """Containers sharing /dev/shm (`--ipc=host`) but not PIDs: a producer's guardian must
    not take another namespace's live files for a dead producer's (nor its own pid's)."""
    import subprocess
    import sys

    from rdt_async.transports import _segments, shm

    ns, other = _segments.pid_namespace(), "4026599999"
    me = subprocess.Popen(["sleep", "60"])  # stands for the producer: alive while the guardian waits
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid of this namespace that no process has now
    files = {
        "dead-here": f"rdt-{dead.pid}-{ns}-aa",
        "dead-there": f"rdt-{dead.pid}-{other}-bb",  # that pid may be alive in its namespace
        "alive-here": f"rdt-{os.getpid()}-{ns}-cc",
        "mine": f"rdt-{me.pid}-{ns}-dd",
        "my-pid-there": f"rdt-{me.pid}-{other}-ee",
        "not-ours": "torch_12_34",
    }
    for name in files.values():
        (tmp_path / name).write_bytes(b"x")
    guardian = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", shm._GUARDIAN, str(tmp_path), "rdt-", str(me.pid), ns], stdin=subprocess.PIPE
    )
    try:
        guardian.wait(10)  # the first child exits; the detached one holds stdin
        wait_until(lambda: not (tmp_path / files["dead-here"]).exists(), 10, lambda: "the dead producer's file swept")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in files.items() if k != "dead-here")
        guardian.stdin.close()  # our producer ends: its own files go, and only those
        wait_until(lambda: not (tmp_path / files["mine"]).exists(), 10, lambda: "the producer's own file swept")
        time.sleep(0.2)
        left = {"dead-there", "alive-here", "my-pid-there", "not-ours"}
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files[k] for k in left)
    finally:
        me.kill()
        me.wait()
    assert _segments.owner(files["mine"]) == (me.pid, ns) and _segments.owner("torch_12_34") is None
    assert _segments.name_prefix() == f"rdt-{os.getpid()}-{ns}-"


def test_an_idle_segment_unlinked_by_someone_else_is_replaced_not_an_error():
    from rdt_async.transports import _segments

    pool = _segments.SegmentPool()
    seg = pool.take(2 << 20, _segments.name_for("a", _segments.new_key(), 2 << 20))
    pool.recycle(seg.name)  # idle, warm, for the next export of its size
    os.unlink(seg.path)  # a tmp cleaner, or a hand
    again = pool.take(2 << 20, _segments.name_for("b", _segments.new_key(), 2 << 20))
    try:
        assert again is not seg and os.path.exists(again.path) and pool.created == 2
    finally:
        pool.discard(again.name)
    assert not os.path.exists(again.path)


def test_the_pool_keeps_two_idle_segments_of_a_size_past_its_bound(monkeypatch):
    """A producer returning one large tensor per step alternates between two segments (a
    consumer holds the last): both stay warm, even where two exceed the pool's bound;
    segments of other sizes go first."""
    from rdt_async.transports import _segments

    monkeypatch.setattr(_segments, "MAX_BYTES", 4 << 20)
    pool = _segments.SegmentPool()
    small = pool.take(1 << 20, _segments.name_for("s", _segments.new_key(), 1 << 20))
    pool.recycle(small.name)
    a = pool.take(4 << 20, _segments.name_for("a", _segments.new_key(), 4 << 20))
    b = pool.take(4 << 20, _segments.name_for("b", _segments.new_key(), 4 << 20))  # `a` still held
    pool.recycle(a.name)
    pool.recycle(b.name)
    assert pool.stats()["idle_bytes"] == 8 << 20 and not os.path.exists(small.path)  # two of 4 MiB, the 1 MiB gone
    taken = [pool.take(4 << 20, _segments.name_for(k, _segments.new_key(), 4 << 20)) for k in "cd"]
    try:
        assert {s.mm for s in taken} == {a.mm, b.mm} and pool.created == 3  # both warm, none made
    finally:
        for s in taken:
            pool.discard(s.name)
    assert pool.stats() == {"idle": 0, "idle_bytes": 0, "used": 0, "created": 3}
