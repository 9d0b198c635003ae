"""Warm shared memory: the producer's pool of segments and a consumer's kept mappings.

Real tmpfs files and mappings; a /dev/shm with little room is a tmpfs of its own in a
process with a private mount namespace (root and `unshare` only: skipped elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from rdt_async import _io
from rdt_async.transports import _mappings, _segments

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _name(nbytes: int) -> str:
    return _segments.name_for(os.urandom(12).hex(), _segments.new_key(), nbytes)


def _wait_until(cond, timeout: float, what=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not true in {timeout} s: {what()}"
        time.sleep(0.02)


def _in_small_shm(code: str, mib: int = 8) -> dict:
    """Run `code` in a process whose /dev/shm is a tmpfs of `mib` MiB (a private mount
    namespace, as a container's); it prints one JSON line last, returned here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give a process a small /dev/shm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RDT_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))
    script = "import json, os\nMIB = 1 << 20\n" + textwrap.dedent(code)
    shell = f"mount --make-rprivate / && mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell, script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def pool():
    p = _segments.SegmentPool()
    yield p
    with p._lock:
        left = p._idle + list(p._used.values())
        p._idle, p._used = [], {}
    for seg in left:
        _segments._drop(seg)


@pytest.mark.parametrize("bad", ["10s", "-1", "nan", "inf", ""])
def test_a_bad_idle_setting_fails_the_take_naming_it_and_leaks_nothing(pool, monkeypatch, bad):
    monkeypatch.setenv("RDT_SHM_IDLE_S", bad)
    with pytest.raises(ValueError, match=r"RDT_SHM_IDLE_S='.*': give the seconds idle warm shared memory is kept, a number >= 0"):
        pool.take(MIB, _name(MIB))
    assert pool.stats() == {"idle": 0, "idle_bytes": 0, "used": 0, "created": 0}
    # Set wrong while a segment is out: its recycling raises before it lets go of it.
    monkeypatch.setenv("RDT_SHM_IDLE_S", "1")
    seg = pool.take(MIB, _name(MIB))
    monkeypatch.setenv("RDT_SHM_IDLE_S", bad)
    with pytest.raises(ValueError, match="RDT_SHM_IDLE_S"):
        pool.recycle(seg.name)
    assert pool.stats()["used"] == 1  # still listed: discarded as any other
    pool.discard(seg.name)
    assert not os.path.exists(seg.path) and pool.stats()["used"] == 0
    cache, fd = _mappings.MappingCache(), os.memfd_create("rdt-test-idle")  # a consumer's first fetch fails too
    try:
        os.ftruncate(fd, MIB)
        with pytest.raises(ValueError, match="RDT_SHM_IDLE_S"):
            cache.open(fd, None)
    finally:
        os.close(fd)
    monkeypatch.setenv("RDT_SHM_IDLE_S", "2.5")
    assert _segments.idle_s() == 2.5
    monkeypatch.delenv("RDT_SHM_IDLE_S")
    assert _segments.idle_s() == 10.0


def test_an_idle_segment_that_cannot_be_renamed_goes_under_its_old_name_and_another_is_made(pool, monkeypatch):
    import errno

    seg = pool.take(MIB, _name(MIB))
    pool.recycle(seg.name)
    old = seg.path

    def refused(src, dst, **kw):
        raise OSError(errno.EIO, "Input/output error", src)

    monkeypatch.setattr(_segments.os, "rename", refused)
    again = pool.take(MIB, _name(MIB))
    monkeypatch.undo()
    assert again is not seg and os.path.exists(again.path) and not os.path.exists(old)
    assert seg.mm.closed and pool.stats() == {"idle": 0, "idle_bytes": 0, "used": 1, "created": 2}


def test_cadences_forget_kinds_not_taken_for_a_while_and_keep_at_most_max_kinds(monkeypatch):
    """The relay notes a kind per capacity and producer: a long-lived consumer sees many."""
    monkeypatch.delenv("RDT_SHM_IDLE_S", raising=False)  # (a cluster fixture sets it: the keep is the cadence's)
    now = [0.0]
    cadence = _segments.Cadence(clock=lambda: now[0])
    for kind in range(3 * _segments.MAX_KINDS):
        cadence.taken(kind)
    assert len(cadence._taken) == _segments.MAX_KINDS and len(cadence._gap) == 0
    now[0] = 1.0
    cadence.taken("steady")
    now[0] = 31.0
    cadence.taken("steady")  # every 30 s: kept up to 60 s
    assert cadence.keep_s("steady") == 60.0 and len(cadence._taken) == _segments.MAX_KINDS
    now[0] = 31.0 + _segments.KEEP_MAX_S + 1
    cadence.taken("late")
    assert list(cadence._taken) == ["late"] and cadence._gap == {}


def test_a_segment_made_but_not_handed_out_is_not_counted_as_created(pool, monkeypatch):
    import errno

    def full(seg, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_segments, "_reserve", full)
    with pytest.raises(OSError, match="No space left"):
        pool.take(MIB, _name(MIB))
    assert pool.stats() == {"idle": 0, "idle_bytes": 0, "used": 0, "created": 0}


def test_segments_let_go_on_the_io_loop_are_unlinked_there_and_unmapped_off_it(pool, monkeypatch):
    """Unmapping takes its thread 20 ms per 256 MiB: the sweep, an eviction and a discard
    (all on the I/O loop) unlink there and hand the unmapping to the pool."""
    monkeypatch.setattr(_segments, "idle_s", lambda: 0.2)
    monkeypatch.setattr(_segments, "MAX_BYTES", MIB)
    unmapped: dict[str, bool] = {}
    real = _segments._unmap
    monkeypatch.setattr(_segments, "_unmap", lambda seg: (unmapped.update({seg.name: _io.on_io_thread()}), real(seg)))
    swept = pool.take(MIB, _name(MIB))
    _io.call_soon(pool.recycle, swept.name)
    _wait_until(lambda: swept.name in unmapped, 10, pool.stats)
    a, b, c, gone = (pool.take(MIB, _name(MIB)) for _ in range(4))
    for seg in (a, b, c):
        _io.call_soon(pool.recycle, seg.name)  # two of a size are kept: the third evicts the first
    _io.call_soon(pool.discard, gone.name)
    _wait_until(lambda: {a.name, gone.name} <= unmapped.keys(), 10, lambda: (unmapped, pool.stats()))
    assert unmapped == {swept.name: False, a.name: False, gone.name: False}
    assert not any(os.path.exists(s.path) for s in (swept, a, gone)) and swept.mm.closed and a.mm.closed


def test_idle_receive_buffers_are_unmapped_off_the_io_loop(monkeypatch):
    import torch

    from rdt_async import _alloc

    monkeypatch.setattr(_alloc, "_free", {})
    monkeypatch.setattr(_alloc, "_cached", 0)
    monkeypatch.setattr(_alloc, "IDLE_S", 0.2)
    monkeypatch.setattr(_alloc, "_sweep_due", False)
    unmapped: list[bool] = []
    real = _alloc._unmap
    monkeypatch.setattr(_alloc, "_unmap", lambda mm: (unmapped.append(_io.on_io_thread()), real(mm)))
    t = _alloc.empty((2 * MIB,), torch.uint8)
    del t
    _wait_until(lambda: unmapped, 10, lambda: _alloc.cached_bytes())
    assert unmapped == [False] and _alloc.cached_bytes() == 0


def test_a_take_with_no_room_lets_go_of_idle_segments_and_tries_again():
    """An idle 4 MiB segment of this producer made a take of 6 MiB fail on an 8 MiB
    /dev/shm; failing still, the error says what was let go of."""
    out = _in_small_shm("""
        from rdt_async.transports import _segments as S

        def name(n):
            return S.name_for(os.urandom(12).hex(), S.new_key(), n)

        a = S.pool.take(3 * MIB, name(3 * MIB))
        a.mm[: 3 * MIB] = b"A" * (3 * MIB)
        S.pool.recycle(a.name)  # idle and warm: 3 MiB of the 8 held
        b = S.pool.take(6 * MIB, name(6 * MIB))
        out = {"after": S.pool.stats(), "files": os.listdir("/dev/shm") == [b.name]}
        c = S.pool.take(MIB, name(MIB))
        S.pool.recycle(c.name)
        try:
            S.pool.take(3 * MIB, name(3 * MIB))  # 1 MiB free, 2 once `c` goes: not enough
        except OSError as exc:
            out["error"] = [exc.errno, exc.strerror]
        out["end"] = S.pool.stats()
        print(json.dumps(out))
    """)
    assert out["after"] == {"idle": 0, "idle_bytes": 0, "used": 1, "created": 2} and out["files"], out
    assert out["error"] == [28, "No space left on device (after letting go of 1.0 MiB of idle warm shared memory)"], out
    assert out["end"] == {"idle": 0, "idle_bytes": 0, "used": 1, "created": 3}, out


def test_a_take_with_no_room_on_an_event_loop_waits_for_nothing_and_the_next_finds_the_room():
    """An async producer prepares a small object inline, on its own loop: the retry must
    not hold that loop (it unmapped every idle segment there, then waited up to
    ROOM_WAIT_S for the pool's unmaps)."""
    out = _in_small_shm("""
        import asyncio, time
        from rdt_async.transports import _segments as S

        def name(n):
            return S.name_for(os.urandom(12).hex(), S.new_key(), n)

        a = S.pool.take(4 * MIB, name(4 * MIB))
        S.pool.recycle(a.name)  # idle: 4 MiB of the 8 held
        S.ROOM_WAIT_S = 30.0

        async def on_loop():
            t0 = time.perf_counter()
            try:
                S.pool.take(6 * MIB, name(6 * MIB))
                return ["taken", time.perf_counter() - t0]
            except OSError as exc:
                return [exc.errno, time.perf_counter() - t0]

        first = asyncio.run(on_loop())
        deadline = time.monotonic() + 10
        while S.pool.stats()["idle"] or S.pool._unmapping:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b = S.pool.take(6 * MIB, name(6 * MIB))  # off the loop: the room is there
        print(json.dumps({"first": first[0], "held_s": first[1], "then": os.path.exists(b.path)}))
    """)
    assert out["first"] == 28 and out["held_s"] < 0.5 and out["then"], out


def test_a_take_with_no_room_lets_go_of_this_processs_mappings_of_unlinked_segments():
    """A process both consumes (it keeps mappings of other producers' segments) and
    produces: the mapping of a segment unlinked since holds its pages until it goes."""
    if not _mappings._keeps():
        pytest.skip("this kernel has no PAGEMAP_SCAN: idle mappings are not kept")
    out = _in_small_shm("""
        import gc
        import torch
        from rdt_async.transports import _mappings as M, _segments as S

        seg = S.pool.take(4 * MIB, S.name_for("a", S.new_key(), 4 * MIB))
        seg.mm[:] = b"A" * (4 * MIB)
        fd = S.open_own(seg.name, 4 * MIB, "test")  # as a consumer's fetch opens and maps it
        view = torch.frombuffer(M.cache.open(fd, None, named=True), dtype=torch.uint8)
        os.close(fd)
        total = int(view.sum())
        del view
        gc.collect()
        kept = M.cache.stats()["idle"]
        S.pool.discard(seg.name)  # its producer frees it: unlinked
        b = S.pool.take(5 * MIB, S.name_for("b", S.new_key(), 5 * MIB))  # at once: before any sweep
        print(json.dumps({"read": total, "kept": kept, "taken": os.path.exists(b.path), "idle": M.cache.stats()["idle"]}))
    """)
    assert out == {"read": 65 * 4 * MIB, "kept": 1, "taken": True, "idle": 0}, out


def test_a_publisher_short_of_room_lets_go_of_idle_segments_before_it_keeps_fewer_slots():
    """A publisher's slot (torch's shared memory) found no room where this process's idle
    warm segments held it: with one slot made, the publisher failed outright."""
    out = _in_small_shm("""
        import asyncio
        import torch
        from rdt_async import _publish
        from rdt_async.transports import _segments as S

        seg = S.pool.take(3 * MIB, S.name_for("obj", S.new_key(), 3 * MIB))
        S.pool.recycle(seg.name)  # idle, holding 3 MiB of the 8
        _publish._check_place = lambda: None  # (a publisher lives in an actor: none here)
        _publish._Slot.busy = lambda self: True  # every slot read: each call makes a new one
        pub = _publish.Publisher("p", slots=3)
        entries = pub._check({"w": torch.zeros(3 * MIB // 4)})
        for _ in range(2):
            asyncio.run(pub._free_slot(entries))
        print(json.dumps({"slots": len(pub._slots), "asked": pub.slots, "pool": S.pool.stats()}))
    """)
    assert out == {"slots": 2, "asked": 3, "pool": {"idle": 0, "idle_bytes": 0, "used": 0, "created": 1}}, out


def test_a_consumers_idle_mapping_of_a_segment_its_producer_unlinked_goes_at_once(monkeypatch):
    """Such a mapping can serve no fetch (the name is gone) but pinned the segment's pages
    in /dev/shm for RDT_SHM_IDLE_S (4 GiB of them at most). Files opened by no name (a
    relay's memfd, a shared storage) keep the idle time."""
    if not _mappings._keeps():
        pytest.skip("this kernel has no PAGEMAP_SCAN: idle mappings are not kept")
    monkeypatch.setenv("RDT_SHM_IDLE_S", "60")
    _io.io_loop()  # (started, as by a consumer's fetches: sweeps run there)
    cache = _mappings.MappingCache()
    paths = [os.path.join(_segments.SHM_DIR, f"rdt-test-{os.getpid()}-{os.urandom(6).hex()}") for _ in range(2)]
    mapped = []
    try:
        for path in paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, MIB)
            mapped.append(cache.open(fd, None, named=True))
            os.close(fd)
        memfd = os.memfd_create("rdt-test-unnamed")
        os.ftruncate(memfd, MIB)
        unnamed = cache.open(memfd, None)
        os.close(memfd)
        held = memoryview(mapped[1])  # a view alive while its file is unlinked
        del mapped[0], unnamed
        assert cache.stats()["idle"] == 2
        for path in paths:
            os.unlink(path)  # the producer frees them
        _wait_until(lambda: cache.stats()["idle"] == 1, 5, cache.stats)  # idle and unlinked: gone
        held.release()
        del held, mapped
        assert cache.stats()["idle"] == 1  # its last view went after the unlink: not kept at all
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        cache.clear()


_CHILD_CHECKS_S = 20


def test_a_forked_child_has_working_pools_and_none_of_its_parents_warm_memory(monkeypatch, tmp_path):
    """A child forked from a process with warm memory (a DataLoader worker) inherited the
    pools' executors without their threads (`to_thread` hung), the parent's idle segments
    and mappings (their pages pinned after the parent let go), sweep flags of sweeps that
    run only in the parent, and locks held by the parent's other threads."""
    import asyncio
    import signal
    import threading

    import torch

    from rdt_async import _alloc

    monkeypatch.setenv("RDT_SHM_IDLE_S", "0.5")
    _io.prestart()  # the pools have threads, in the parent
    monkeypatch.setattr(_alloc, "_free", {})
    monkeypatch.setattr(_alloc, "_cached", 0)
    buf = _alloc.empty((2 * MIB,), torch.uint8)
    del buf
    assert _alloc.cached_bytes() == 2 * MIB
    seg = _segments.pool.take(MIB, _name(MIB))
    _segments.pool.recycle(seg.name)
    path = str(tmp_path / "stand-in")  # a file opened by name, its mapping kept idle
    kept = _mappings._keeps()
    if kept:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, MIB)
        view = _mappings.cache.open(fd, None)
        os.close(fd)
        del view
        assert _mappings.cache.stats()["idle"] >= 1
    read, write = os.pipe()
    held = threading.Event()
    release = threading.Event()

    def hold_locks() -> None:  # another thread of the parent holds the pools' locks at the fork
        with _alloc._lock, _segments.pool._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_locks)
    holder.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: check, say each as it comes (a check that hangs says the rest), leave at once
        try:
            signal.alarm(_CHILD_CHECKS_S)
            os.close(read)

            def say(what: str, value) -> None:
                os.write(write, (json.dumps([what, value]) + "\n").encode())

            async def in_pool() -> int:
                return await asyncio.wait_for(_io.to_thread(lambda: 42), 3)

            try:
                say("to_thread", asyncio.run(in_pool()))
            except TimeoutError:
                say("to_thread", "hung")
            say("alloc cached", _alloc.cached_bytes())
            say("parent's segment mapped here", not seg.mm.closed)
            say("mappings idle", _mappings.cache.stats()["idle"])
            say("alloc works", _alloc.empty((2 * MIB,), torch.uint8).numel() == 2 * MIB)  # (its lock was held)
            say("segments", _segments.pool.stats())
            mine = _segments.pool.take(MIB, _name(MIB))
            _segments.pool.recycle(mine.name)
            deadline = time.monotonic() + 5
            while _segments.pool.stats()["idle"] and time.monotonic() < deadline:
                time.sleep(0.05)
            say("own idle segment swept", _segments.pool.stats()["idle"] == 0 and not os.path.exists(mine.path))
        finally:
            os._exit(0)
    os.close(write)
    release.set()
    holder.join()
    deadline = time.monotonic() + _CHILD_CHECKS_S + 5
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with os.fdopen(read, "rb") as f:
        said = dict(json.loads(line) for line in f.read().decode().splitlines())
    _segments.pool.make_room()  # (the parent's idle segment)
    assert said == {
        "to_thread": 42,
        "alloc cached": 0,
        "parent's segment mapped here": False,
        "mappings idle": 0,
        "alloc works": True,
        "segments": {"idle": 0, "idle_bytes": 0, "used": 0, "created": 0},
        "own idle segment swept": True,
    }


def test_a_discard_unlinks_no_file_of_another_process(pool):
    """A forked child's copy of an object names its parent's segment: freeing it there must
    leave the parent's file alone."""
    parent = os.getppid()
    name = _segments.name_for("obj", _segments.new_key(), MIB, pid=parent)
    path = os.path.join(_segments.SHM_DIR, name)
    with open(path, "wb"):
        pass
    try:
        pool.discard(name)
        assert os.path.exists(path)
        mine = _name(MIB)
        with open(os.path.join(_segments.SHM_DIR, mine), "wb"):
            pass
        pool.discard(mine)  # (one of ours not in the pool: a lazy export that lost a race)
        assert not os.path.exists(os.path.join(_segments.SHM_DIR, mine))
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_memory_let_go_as_the_interpreter_exits_is_unmapped_in_place(pool, monkeypatch):
    """A sweep may run after the pools were shut down at exit (they take no work then):
    it unmaps in place instead of raising out of the I/O loop."""
    import concurrent.futures

    import torch

    from rdt_async import _alloc

    shut = concurrent.futures.ThreadPoolExecutor(1)
    shut.shutdown()
    monkeypatch.setattr(_io, "pool", lambda purpose=_io.COPIES: shut)
    monkeypatch.setattr(_alloc, "_free", {})
    monkeypatch.setattr(_alloc, "_cached", 0)
    monkeypatch.setattr(_alloc, "IDLE_S", 0.0)
    monkeypatch.setattr(_alloc, "_sweep_due", True)  # (no sweep scheduled: this test runs it)
    buf = _alloc.empty((2 * MIB,), torch.uint8)
    del buf
    _io.settle()
    (mm,) = [mm for free in _alloc._free.values() for _, mm in free]
    _alloc._sweep()
    assert mm.closed and _alloc.cached_bytes() == 0
    seg = pool.take(MIB, _name(MIB))
    monkeypatch.setattr(pool._sweeper, "start", lambda after=None: None)
    pool.recycle(seg.name)
    assert pool._sweep(float("inf")) is None and seg.mm.closed and not os.path.exists(seg.path)
