"""cuda_ipc's bookkeeping, on any machine: the liveness table is real shared memory and the
pids real processes; only what needs a GPU (the driver's calls, the device copy) is a
stand-in. The transfers themselves run in the contract suite on the GPU machine.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading

import pytest
import torch

import rdt_async as rdt
from rdt_async.transports import _cudadrv, _kit, shm
from rdt_async.transports._base import TensorSpec, TransferInfo

SPECS = (TensorSpec((256,), torch.float32, "cuda:0", 1024),)


class FakeDriver:
    """libcuda's calls that `_cudadrv` makes, with a current context per thread (device i's
    primary context is CTX + i) and the context each call ran in."""

    CTX = 0x1000

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.tls = threading.local()
        self.fail = fail or {}
        self.ran_in: list[tuple[str, int | None]] = []

    def current(self) -> int | None:
        return getattr(self.tls, "ctx", None)

    def _call(self, name: str) -> int:
        self.ran_in.append((name, self.current()))
        return self.fail.get(name, 0)

    def cuDeviceGet(self, dev, ordinal):
        dev._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        ctx._obj.value = self.CTX + dev.value
        return 0

    def cuCtxGetCurrent(self, ctx):
        ctx._obj.value = self.current()
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.tls.ctx = ctx
        return 0

    def cuGetErrorString(self, code, msg):
        msg._obj.value = b"stand-in error"
        return 0

    def cuMemGetAddressRange_v2(self, base, size, ptr):
        base._obj.value, size._obj.value = ptr & ~0xFFFF, 1 << 20
        return self._call("cuMemGetAddressRange")

    def cuIpcGetMemHandle(self, handle, base):
        ctypes.memmove(ctypes.addressof(handle._obj), b"h" * _cudadrv.HANDLE_BYTES, _cudadrv.HANDLE_BYTES)
        return self._call("cuIpcGetMemHandle")

    def cuIpcOpenMemHandle_v2(self, ptr, handle, flags):
        ptr._obj.value = 0x7000_0000
        return self._call("cuIpcOpenMemHandle")

    def cuIpcCloseMemHandle(self, ptr):
        return self._call("cuIpcCloseMemHandle")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(_cudadrv, "_lib", lambda: fake)
    monkeypatch.setattr(_cudadrv, "_contexts", {})
    return fake


@pytest.mark.parametrize("before", [FakeDriver.CTX, None], ids=["on-cuda0", "no-context"])
def test_driver_calls_run_in_the_devices_context_and_leave_the_callers_current(driver, before):
    """A producer on cuda:0 that returns a tensor of cuda:1 exports it on its own thread
    (cuda_ipc prepares inline): its thread must still work on cuda:0 afterwards, as must
    the pool threads that map and unmap for consumers."""
    driver.tls.ctx = before
    cuda1 = FakeDriver.CTX + 1
    handle, base, size = _cudadrv.export(0x7F00_1234, 1)
    assert (handle, base, size) == (b"h" * 64, 0x7F00_0000, 1 << 20)
    assert driver.current() == before
    address = _cudadrv.open_handle(handle, 1)
    assert _cudadrv.bytes_from(address + 16, 1) == (1 << 20) - 16
    _cudadrv.close_handle(address, 1)
    assert driver.current() == before
    assert driver.ran_in == [
        ("cuMemGetAddressRange", cuda1), ("cuIpcGetMemHandle", cuda1), ("cuIpcOpenMemHandle", cuda1),
        ("cuMemGetAddressRange", cuda1), ("cuIpcCloseMemHandle", cuda1),
    ]
    driver.fail["cuIpcOpenMemHandle"] = 217
    with pytest.raises(_cudadrv.CudaDriverError, match=r"cuIpcOpenMemHandle failed: CUDA error 217 \(stand-in error\)"):
        _cudadrv.open_handle(handle, 1)
    assert driver.current() == before  # restored on failure too


@pytest.fixture
def stand_in_maps(monkeypatch):
    """cuda_ipc's mapping calls as stand-ins: `opened`/`closed` list (address, device) of each
    open and close, `wrapped` (address, bytes, device) of each tensor made of a mapping.
    The producer's GPU is not visible here (peer access): a segment maps on the thread's
    current device, `current[0]`. Every `_Mappings` made meanwhile has closed all it mapped
    at the end (while the stand-ins are still in place)."""
    import time

    from rdt_async.transports import cuda_ipc

    log = {"opened": [], "closed": [], "wrapped": [], "current": [0]}
    made = []

    class Mappings(cuda_ipc._Mappings):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(cuda_ipc, "_Mappings", Mappings)
    monkeypatch.setattr(cuda_ipc, "_mappings", Mappings())  # receive's

    def open_handle(handle: bytes, index: int) -> int:
        address = 0x7000_0000 + 0x100_0000 * len(log["opened"])
        log["opened"].append((address, index))
        return address

    monkeypatch.setattr(_cudadrv, "open_handle", open_handle)
    monkeypatch.setattr(_cudadrv, "bytes_from", lambda ptr, index: 1 << 20)
    monkeypatch.setattr(_cudadrv, "close_handle", lambda ptr, index: log["closed"].append((ptr, index)))
    monkeypatch.setattr(cuda_ipc, "_uuids", dict)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: log["current"][0])
    monkeypatch.setattr(cuda_ipc, "_wrap", lambda a, n, index: log["wrapped"].append((a, n, index)) or (a, n, index))
    yield log
    for _ in range(100):
        if not any(maps._maps for maps in made):
            break
        time.sleep(0.02)
    assert not any(maps._maps for maps in made), "a mapping was left open"


async def test_a_shared_mapping_is_read_on_its_own_device_whatever_the_fetching_threads(stand_in_maps):
    """Fetches share one mapping per segment, made on the first fetch's device where the
    producer's GPU is hidden here. A fetch from a thread on another device reads it as a
    tensor of the mapping's device (another would make torch copy it, blocking the loop)
    and lands its fresh tensors there too."""
    from rdt_async.transports import cuda_ipc

    maps, m = cuda_ipc._Mappings(), cuda_ipc.IpcTensor("GPU-hidden", b"h" * 64, 256, 4096)
    with maps.using([m]) as first:
        await first.mapped()
        stand_in_maps["current"][0] = 1  # another thread's fetch, on cuda:1
        with maps.using([m]) as second:
            await second.mapped()
            assert stand_in_maps["wrapped"] == [(0x7000_0100, 4096, 0)] * 2
            assert second.devices == first.devices == [torch.device("cuda", 0)]
    assert stand_in_maps["opened"] == [(0x7000_0000, 0)]


@pytest.fixture
def slot():
    """A producer's liveness slot for obj-A (real shared memory), and a ref to it:
    (producer, consumer, info)."""
    from rdt_async.transports import cuda_ipc

    producer, consumer = cuda_ipc.CudaIpcTransport(), cuda_ipc.CudaIpcTransport()
    exports = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 0, 1024),)
    table, n, token = producer._take_slot(_kit.digest("obj-A", exports))
    producer._objects["obj-A"] = (n, [])
    meta = cuda_ipc.CudaIpcMeta(cuda_ipc._host(), os.getpid(), exports, table, n, token)
    yield producer, consumer, TransferInfo("obj-A", SPECS, meta, producer_pid=os.getpid())
    for t in (*producer._tables, *consumer._mapped.values()):
        t.close()
    os.unlink(os.path.join(shm.SHM_DIR, table))


def test_a_ref_freed_while_it_is_checked_is_freed_not_altered(slot, monkeypatch):
    """The check reads the slot's token, then the digest of the exports bound to it: a free
    and the slot's reuse by the next object in between (freed slots are reused first) is a
    freed object, not a ref someone altered."""
    from rdt_async.transports import cuda_ipc

    producer, consumer, info = slot
    real = cuda_ipc._Table.token

    def token_then_free(table, n):
        token = real(table, n)
        monkeypatch.setattr(cuda_ipc._Table, "token", real)
        producer.garbage_collect("obj-A", info.meta)
        other = (cuda_ipc.IpcTensor("GPU-0", b"b" * 64, 0, 8),)
        assert producer._take_slot(_kit.digest("obj-B", other))[1] == info.meta.slot
        return token

    monkeypatch.setattr(cuda_ipc._Table, "token", token_then_free)
    with pytest.raises(rdt.ObjectFreedError, match=r"cuda_ipc fetch of obj-A: the producer no longer holds it \(freed before the fetch\)"):
        consumer._check_live(info)


def test_a_table_evicted_from_the_cache_while_a_fetch_reads_it_stays_readable(slot, monkeypatch):
    """A consumer keeps TABLE_CACHE producers' tables: the next evicted the oldest and closed
    it, while another fetch of that producer could be reading it (a released memoryview)."""
    from rdt_async.transports import cuda_ipc

    _, consumer, info = slot
    monkeypatch.setattr(cuda_ipc, "TABLE_CACHE", 1)
    held = consumer._table(info.meta.table)  # a fetch reading it
    created = cuda_ipc._Table("rdt-1-1-ipc-" + "0" * 16, create=True)
    try:
        consumer._table(created.name)  # evicts `held`'s entry
        assert info.meta.table not in consumer._mapped
        assert held.token(info.meta.slot) == info.meta.token  # still readable: not closed under the fetch
        fd = held._fd
        del held
        import gc

        gc.collect()
        try:
            target: str | None = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = None
        assert target is None or info.meta.table not in target  # the fd went with the last holder
    finally:
        created.close()
        os.unlink(os.path.join(shm.SHM_DIR, created.name))


# A producer in a PID namespace of its own (a container sharing the host's /dev/shm but
# not its PIDs): it holds obj-A's slot, prints its pid there, its table, slot and token,
# and ends when its stdin closes (its guardian then unlinks the table).
PRODUCER = """
import json, sys
from rdt_async.transports import _kit, cuda_ipc
p = cuda_ipc.CudaIpcTransport()
exports = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 0, 1024),)
table, slot, token = p._take_slot(_kit.digest("obj-A", exports))
print(json.dumps([os.getpid(), table, slot, token]), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def producer_of_another_pid_namespace():
    """Start PRODUCER under `unshare --pid`, as a pid that names no process here (set with
    ns_last_pid); yield (its Popen, its pid there, table, slot, token). Skips where PID
    namespaces cannot be made."""
    import json
    import shutil
    import subprocess
    import sys

    from rdt_async._local import pid_alive

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to run a producer in a PID namespace of its own")
    pid = next(p for p in range(54321, 1 << 22) if not pid_alive(p))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # sh is the namespace's init: it outlives the producer until its guardian has unlinked
    # the table (the guardian ends with the namespace's init).
    shell = (
        f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" -c "import os; $1"; '
        f"for i in $(seq 100); do ls {shm.SHM_DIR} | grep -q '^rdt-{pid}-' || break; sleep 0.05; done"
    )
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", shell, sys.executable, PRODUCER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.skip(f"a producer in a PID namespace of its own did not start (exit {proc.wait(10)})")
        got = json.loads(line)
        assert got[0] == pid, f"the producer is pid {got[0]} in its namespace, not {pid}"
        yield proc, *got
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_live_producer_in_another_pid_namespace_is_read_and_one_that_ended_has_died(producer_of_another_pid_namespace):
    """Its pid means nothing here (no process has it): the producer is judged alive by its
    liveness table, which its guardian unlinks when it ends."""
    import time

    from rdt_async.transports import _segments, cuda_ipc

    proc, pid, table, n, token = producer_of_another_pid_namespace
    assert _segments.owner(table)[1] != _segments.pid_namespace()
    exports = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 0, 1024),)
    meta = cuda_ipc.CudaIpcMeta(cuda_ipc._host(), pid, exports, table, n, token)
    info = TransferInfo("obj-A", SPECS, meta, producer_pid=pid)
    consumer = cuda_ipc.CudaIpcTransport()
    try:
        consumer._check_live(info)  # alive, and holds obj-A
        consumer._check_live(info, during=True)
        proc.stdin.close()  # the producer ends
        for _ in range(100):
            if not os.path.exists(os.path.join(shm.SHM_DIR, table)):
                break
            time.sleep(0.05)
        with pytest.raises(rdt.PeerDiedError, match=rf"the producer \(pid {pid}\) died \(its liveness table is gone\)"):
            consumer._check_live(info, during=True)
    finally:
        for t in consumer._mapped.values():
            t.close()


def test_a_live_producer_whose_table_is_not_here_does_not_share_our_dev_shm():
    """A producer alive (this process) whose liveness table is not in our /dev/shm: the
    two do not share it (a container with a /dev/shm of its own), which is no death."""
    from rdt_async.transports import _segments, cuda_ipc

    table = f"{_segments.name_prefix()}ipc-{'0' * 16}"
    exports = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 0, 1024),)
    meta = cuda_ipc.CudaIpcMeta(cuda_ipc._host(), os.getpid(), exports, table, 0, 1)
    info = TransferInfo("obj-A", SPECS, meta, producer_pid=os.getpid())
    with pytest.raises(
        rdt.TransportUnavailableError,
        match=rf"liveness table /dev/shm/{table} is not here: the producer \(pid {os.getpid()}\) is alive but this "
        r"process does not share the producer's /dev/shm .*--ipc=host.*tensor_transport='nixl'",
    ):
        cuda_ipc.CudaIpcTransport()._check_live(info)


async def test_a_freed_objects_memory_is_held_until_the_consumers_mapping_of_it_is_closed(slot, stand_in_maps, monkeypatch):
    """A fetch that checked the slot just before a free ends as the object is freed. The
    producer may let the allocator have the segment back (and cudaFree it) only once the
    consumer has closed its mapping, idle since that fetch: cudaFree of memory another
    process maps is undefined. (The tensors are CPU stand-ins; the timers are the real ones.)"""
    import time
    import weakref

    from rdt_async.transports import cuda_ipc

    producer, _, info = slot
    kept = torch.zeros(1024, dtype=torch.uint8)
    producer._objects["obj-A"] = (producer._objects["obj-A"][0], [kept])
    released, closed = [], []
    weakref.finalize(kept, lambda: released.append(time.monotonic()))
    del kept
    monkeypatch.setattr(_cudadrv, "close_handle", lambda ptr, index: closed.append(time.monotonic()))

    maps = cuda_ipc._Mappings()
    with maps.using(list(info.meta.tensors)) as use:
        await use.mapped()
    producer.garbage_collect("obj-A", info.meta)  # as the fetch ends
    for _ in range(200):
        if released and closed:
            break
        await asyncio.sleep(0.02)
    assert closed and released, (closed, released)
    assert closed[0] < released[0], f"the producer let go {closed[0] - released[0]:.2f} s before the consumer's mapping closed"


async def test_a_fetch_that_cannot_count_all_its_segments_lets_go_of_those_it_counted(stand_in_maps, monkeypatch):
    from rdt_async.transports import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "MAP_IDLE_S", 0.05)
    maps = cuda_ipc._Mappings()
    first, second = (cuda_ipc.IpcTensor(f"GPU-{i}", bytes([i]) * 64, 0, 64) for i in (1, 2))
    real = cuda_ipc._map_index
    monkeypatch.setattr(cuda_ipc, "_map_index", lambda m: 1 / 0 if m is second else real(m))
    with pytest.raises(ZeroDivisionError), maps.using([first, second]):
        pass
    assert maps._maps[first.handle].users == 0  # counted, then let go
    for _ in range(100):
        if stand_in_maps["closed"]:
            break
        await asyncio.sleep(0.02)
    assert stand_in_maps["closed"] == [(0x7000_0000, 0)] and not maps._maps  # closed once idle


async def test_a_mapping_the_pool_cannot_run_fails_its_fetches_and_is_not_kept(stand_in_maps, monkeypatch):
    """At exit rdt_async's pools are shut down: a new mapping cannot be submitted, and one
    queued is cancelled. Neither may leave a mapping that later fetches wait for forever."""
    import concurrent.futures

    from rdt_async import _io
    from rdt_async.transports import cuda_ipc

    maps, m = cuda_ipc._Mappings(), cuda_ipc.IpcTensor("GPU-x", b"h" * 64, 0, 64)

    async def fetch():
        with maps.using([m]) as use:
            await use.mapped()
            return use.sources

    shut = concurrent.futures.ThreadPoolExecutor(1)
    shut.shutdown()
    busy, go = concurrent.futures.ThreadPoolExecutor(1), threading.Event()
    busy.submit(go.wait, 10)  # its one thread busy: a mapping is queued behind
    with monkeypatch.context() as patch:
        patch.setattr(_io, "pool", lambda *_: shut)
        with pytest.raises(RuntimeError, match="after shutdown"):
            await fetch()
        patch.setattr(_io, "pool", lambda *_: busy)
        queued = asyncio.ensure_future(fetch())
        await asyncio.sleep(0.05)
        busy.shutdown(wait=False, cancel_futures=True)
        go.set()
        with pytest.raises(rdt.TransferError, match="the process is exiting; the producer's memory was not mapped"):
            await asyncio.wait_for(queued, 5)
    # rdt_async's pool again: the next fetch maps the segment
    assert await asyncio.wait_for(fetch(), 5) == [(0x7000_0000, 64, 0)]


async def test_a_segment_that_cannot_be_unmapped_is_logged(stand_in_maps, monkeypatch, caplog):
    from rdt_async.transports import cuda_ipc

    def close_handle(ptr, index):
        raise _cudadrv.CudaDriverError("cuIpcCloseMemHandle", 201, "invalid device context")

    monkeypatch.setattr(_cudadrv, "close_handle", close_handle)
    monkeypatch.setattr(cuda_ipc, "MAP_IDLE_S", 0.05)
    maps, m = cuda_ipc._Mappings(), cuda_ipc.IpcTensor("GPU-x", b"h" * 64, 0, 64)
    with maps.using([m]) as use:
        await use.mapped()
    for _ in range(100):
        if caplog.records:
            break
        await asyncio.sleep(0.02)
    assert [r.getMessage() for r in caplog.records] == [
        "rdt_async: cuda_ipc could not unmap a producer's segment at 0x70000000 on cuda:0: "
        "cuIpcCloseMemHandle failed: CUDA error 201 (invalid device context)"
    ]


def _refusing(code: int, before=lambda: None):
    """A stand-in for `_cudadrv.open_handle` that runs `before`, then fails with CUresult `code`."""

    def open_handle(handle: bytes, index: int) -> int:
        before()
        raise _cudadrv.CudaDriverError("cuIpcOpenMemHandle", code, "stand-in")

    return open_handle


@pytest.mark.parametrize(
    ("code", "error", "message"),
    [
        (217, rdt.TransportUnavailableError, r"CUDA error 217 \(stand-in\)\): CUDA IPC needs the producer's GPU visible in this process or peer access"),
        (101, rdt.TransportUnavailableError, r"CUDA error 101 \(stand-in\)\): CUDA IPC needs"),
        (400, rdt.TransferError, r"cannot map the producer's memory on GPU GPU-0 from cuda:0 here \(cuIpcOpenMemHandle failed: CUDA error 400 \(stand-in\)\)$"),
    ],
)
async def test_a_mapping_refused_is_blamed_on_peer_access_only_for_its_curesults(slot, stand_in_maps, monkeypatch, code, error, message):
    _, consumer, info = slot
    monkeypatch.setattr(_cudadrv, "open_handle", _refusing(code))
    with pytest.raises(error, match=message) as got:
        await consumer.receive(info, None, None)
    assert type(got.value) is error


async def test_a_mapping_refused_because_the_object_was_freed_is_a_freed_object(slot, stand_in_maps, monkeypatch):
    producer, consumer, info = slot
    monkeypatch.setattr(_cudadrv, "open_handle", _refusing(1, lambda: producer.garbage_collect("obj-A", info.meta)))
    with pytest.raises(rdt.ObjectFreedError, match=r"cuda_ipc fetch of obj-A: the producer no longer holds it"):
        await consumer.receive(info, None, None)


async def test_a_mapping_refused_because_the_producer_died_is_its_death(stand_in_maps, monkeypatch):
    """A producer (a real process) that dies while its segment is being mapped."""
    import subprocess
    import sys

    from rdt_async.transports import _segments, cuda_ipc

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    table = cuda_ipc._Table(f"rdt-{proc.pid}-{_segments.pid_namespace()}-ipc-{'1' * 16}", create=True)
    exports = (cuda_ipc.IpcTensor("GPU-0", b"a" * 64, 0, 1024),)
    table.words[0], table.words[1] = 7, _kit.digest("obj-A", exports)  # slot 0: token 7
    consumer = cuda_ipc.CudaIpcTransport()
    meta = cuda_ipc.CudaIpcMeta(cuda_ipc._host(), proc.pid, exports, table.name, 0, 7)
    info = TransferInfo("obj-A", SPECS, meta, producer_pid=proc.pid)

    def dies() -> None:
        proc.kill()
        proc.wait()

    monkeypatch.setattr(_cudadrv, "open_handle", _refusing(1, dies))
    try:
        with pytest.raises(rdt.PeerDiedError, match=rf"cuda_ipc fetch of obj-A: the producer \(pid {proc.pid}\) died"):
            await consumer.receive(info, None, None)
    finally:
        proc.kill()
        for t in (table, *consumer._mapped.values()):
            t.close()
        os.unlink(os.path.join(shm.SHM_DIR, table.name))


async def test_a_read_into_buffers_that_raced_a_free_says_the_buffers_hold_no_valid_value(slot, stand_in_maps, monkeypatch):
    """The copy ran after the free (its bytes may be other tensors' by then): the buffers
    it wrote hold nothing the caller may use, and the error says so. (The mapped segment
    is a CPU tensor here, copied into CPU buffers as a GPU one would be.)"""
    from rdt_async.transports import cuda_ipc

    producer, consumer, info = slot
    segment = torch.arange(1024, dtype=torch.int32).view(torch.uint8)
    monkeypatch.setattr(cuda_ipc, "_wrap", lambda a, n, index: segment[:n])
    into = [torch.zeros(256, dtype=torch.float32)]
    got = await consumer.receive(info, into, None)  # held: read whole
    assert got[0] is into[0] and torch.equal(into[0].view(torch.int32), torch.arange(256, dtype=torch.int32))

    def freed_then_wrapped(a, n, index):
        producer.garbage_collect("obj-A", info.meta)  # before the copy
        return segment[:n]

    monkeypatch.setattr(cuda_ipc, "_wrap", freed_then_wrapped)
    with pytest.raises(
        rdt.ObjectFreedError,
        match=r"cuda_ipc fetch of obj-A: the producer no longer holds it \(freed during the read\); the into= "
        r"buffers hold no valid value \(the copy into them may have read memory the producer's allocator had",
    ):
        await consumer.receive(info, into, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real driver: the GPU machine's run")
def test_exporting_with_the_real_driver_leaves_the_threads_context_and_device():
    """On the GPU machine: a thread with no CUDA context keeps none after an export; one
    working on cuda:0 keeps its context, and with two GPUs exports a cuda:1 tensor and
    still allocates on cuda:0."""
    from concurrent.futures import ThreadPoolExecutor

    def current() -> int:
        ctx = ctypes.c_void_p()
        assert _cudadrv._lib().cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value or 0

    t0 = torch.ones(1 << 20, device="cuda:0")
    t1 = torch.ones(1 << 20, device="cuda:1") if torch.cuda.device_count() > 1 else None

    def fresh_thread() -> tuple[int, int]:
        before = current()
        _cudadrv.export(t0.data_ptr(), 0)
        return before, current()

    def on_cuda0() -> tuple[int, int, int, str]:
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")
        before = current()
        _cudadrv.export(t0.data_ptr(), 0)
        if t1 is not None:
            _cudadrv.export(t1.data_ptr(), 1)
        return before, current(), torch.cuda.current_device(), str(torch.empty(1, device="cuda").device)

    with ThreadPoolExecutor(1) as pool:
        before, after = pool.submit(fresh_thread).result()
    assert after == before  # (none, where the runtime has not made one current there)
    with ThreadPoolExecutor(1) as pool:
        before, after, device, allocated = pool.submit(on_cuda0).result()
    assert before != 0 and after == before and (device, allocated) == (0, "cuda:0")
