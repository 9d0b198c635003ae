"""NIXL between actors and the driver: one-sided reads, exact lifetime, idle agents."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("nixl")

import ray
import torch
from conftest import ON_NODE2, wait_until
from helpers import Probed, checksum, cpu_seconds, idle_cpu
from probes import cancel_after, nixl_stalling

import rdt_async as rdt
from rdt_async import _io
from rdt_async.transports import _registry
from rdt_async.transports.nixl import _scratch

pytestmark = pytest.mark.usefixtures("ray_session")


def nixl_state() -> dict:
    """This process's store and NIXL registrations."""
    t = _registry.transport("nixl")
    return {**rdt.store_stats(), "registrations": t.registrations, "registered_bytes": t.registered_bytes}


def use_costs(path: str) -> None:
    """Have `auto` in this process rank transports by the cost table at `path` (none: "")."""
    if path:
        os.environ["RDT_AUTO_COSTS"] = path
    else:
        os.environ.pop("RDT_AUTO_COSTS", None)


def make_value(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g)
    return {
        "w": base,
        "pair": (base[: n // 2], torch.arange(12, dtype=torch.int32).reshape(3, 4).t()),  # view, strided
        "more": [torch.linspace(0, 1, 7).to(torch.bfloat16), torch.tensor([True, False]), torch.empty(0)],
        "step": seed,
    }


def assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


@rdt.remote
class NixlProducer:
    """A sync actor whose tensors go out over NIXL."""

    def __init__(self) -> None:
        self.base = torch.arange(1 << 16, dtype=torch.float32)

    @rdt.method(tensor_transport="nixl")
    def make(self, n: int, seed: int = 0):
        return make_value(n, seed)

    @rdt.method(tensor_transport="nixl")
    def big(self, n: int):
        return torch.full((n,), 3.0)

    @rdt.method(tensor_transport="nixl")
    def views(self):
        return [self.base[:100], self.base[100:300], self.base]

    def base_registrations(self) -> int:
        """How many NIXL registrations hold `base`'s storage now (its views share one)."""
        memory = _registry.transport("nixl")._current().memory  # type: ignore[attr-defined]
        ptr = self.base.untyped_storage().data_ptr()
        with memory._lock:
            return sum(r.keep.untyped_storage().data_ptr() == ptr for r in memory._regs.values())

    @rdt.method(tensor_transport="nixl")
    def kept(self, which: str):
        """Tensors that outlive their objects: each storage keeps one registration."""
        if not hasattr(self, "a"):
            self.a = torch.arange(1000, dtype=torch.int64)
            self.b = torch.linspace(-1, 1, 3000, dtype=torch.float64)
        return {"w": self.a, "which": "a"} if which == "a" else {"w": self.b, "which": "b"}

    @rdt.method(tensor_transport="auto")
    def auto(self, n: int):
        return torch.full((n,), 2.0)

    def put(self, n: int):
        return [rdt.put({"x": torch.full((n,), 5.0)}, tensor_transport="nixl")]

    def state(self):
        return nixl_state()

    def use_costs(self, path: str) -> None:
        use_costs(path)

    def idle_cpu(self, seconds: float) -> float:
        return idle_cpu(seconds)

    def pid(self) -> int:
        return os.getpid()


@rdt.remote
class AsyncNixlProducer:
    @rdt.method(tensor_transport="nixl")
    async def make(self, n: int, seed: int = 0):
        await asyncio.sleep(0)
        return make_value(n, seed)


@rdt.remote
class FreshAsyncProducer(Probed):
    """An async actor whose first nixl object makes its NIXL agent (~0.45 s)."""

    @rdt.method(tensor_transport="nixl")
    async def make(self, n: int):
        return torch.full((n,), 2.0)


@rdt.remote
class FreshAutoProducer(Probed):
    """A producer whose first `auto` object is the first of its process."""

    @rdt.method(tensor_transport="auto")
    async def auto(self, n: int):
        return torch.full((n,), 2.0)


@rdt.remote
class SyncConsumer:
    def checksums(self, value):
        return [checksum(value["w"]), value["step"]]


@rdt.remote
class NixlConsumer:
    """An async consumer (like helpers.AsyncConsumer) that can report its NIXL state."""

    async def checksums(self, *values):
        return [checksum(v["w"] if isinstance(v, dict) else v) for v in values]

    async def fetch(self, refs):
        return await rdt.fetch(refs[0])

    async def fetch_all(self, refs):
        return await rdt.fetch_all(refs)

    async def stats(self):
        return rdt.store_stats()

    async def fetch_into_zeros(self, refs):
        buf = torch.zeros(1 << 20)
        out = await rdt.fetch(refs[0], into=buf)
        return out.data_ptr() == buf.data_ptr(), checksum(buf)

    async def cancel_then_fetch(self, refs):
        first = await cancel_after(rdt.fetch(refs[0]), 0.005)
        again = await rdt.fetch(refs[0])
        return first, checksum(again)

    async def fetch_each_dropping(self, refs):
        """Fetch one by one, dropping each value first: receive buffers are reused."""
        sums, ptrs = [], set()
        for r in refs:
            v = await rdt.fetch(r)
            sums.append(checksum(v))
            ptrs.add(v.data_ptr())
            del v
        return sums, len(ptrs)

    async def state(self):
        return nixl_state() if "nixl" in rdt.store_stats()["fetches"] else rdt.store_stats()

    async def use_costs(self, path: str) -> None:
        use_costs(path)


@pytest.fixture(scope="module")
def producer():
    p = NixlProducer.remote()
    yield p
    ray.kill(p)


@pytest.fixture(scope="module")
def consumer():
    c = NixlConsumer.remote()
    yield c
    ray.kill(c)


@pytest.fixture(scope="module")
def far_reader():
    """A NixlConsumer on the other node."""
    c = NixlConsumer.options(**ON_NODE2).remote()
    yield c
    ray.kill(c)


def test_actor_to_sync_and_async_actors(producer, consumer):
    ref = producer.make.remote(1000, seed=1)
    want = checksum(make_value(1000, 1)["w"])
    assert ray.get(consumer.checksums.remote(ref)) == [want]
    sync = SyncConsumer.remote()
    assert ray.get(sync.checksums.remote(ref)) == [want, 1]
    assert ray.get(consumer.stats.remote())["fetches"]["nixl"] >= 1
    ray.kill(sync)


def test_async_producer_and_nested_values_reach_the_driver(consumer):
    p = AsyncNixlProducer.remote()
    got = rdt.get(p.make.remote(333, seed=2), timeout=60)
    assert_same(got, make_value(333, 2))
    assert got["pair"][1].is_contiguous()  # strided tensors arrive dense, values equal
    value = ray.get(consumer.fetch.remote([p.make.remote(50, seed=3)]))
    assert_same(value, make_value(50, 3))
    ray.kill(p)


def test_driver_put_is_read_by_actors_and_actor_put_by_the_driver(producer, consumer):
    value = {"a": [torch.arange(10_000, dtype=torch.float64)], "b": (torch.ones(3, 3).t(),)}
    ref = rdt.put(value, tensor_transport="nixl")
    assert_same(ray.get(consumer.fetch.remote([ref])), value)
    remote_ref = ray.get(producer.put.remote(4096))[0]
    assert_same(rdt.get(remote_ref, timeout=60), {"x": torch.full((4096,), 5.0)})
    del ref
    wait_until(lambda: nixl_state()["registrations"] == 0, 10, nixl_state)


def test_many_concurrent_reads(producer, consumer):
    refs = [producer.make.remote(4096 + i, seed=10 + i) for i in range(16)]
    values = ray.get(consumer.fetch_all.remote(refs))
    for i, v in enumerate(values):
        assert_same(v, make_value(4096 + i, 10 + i))

    async def driver():
        return await rdt.fetch_all(refs)

    for i, v in enumerate(asyncio.run(driver())):
        assert checksum(v["w"]) == checksum(make_value(4096 + i, 10 + i)["w"])


def test_into_reads_straight_into_caller_buffers(producer, consumer):
    ref = producer.big.remote(1 << 20)
    same, total = ray.get(consumer.fetch_into_zeros.remote([ref]))
    assert same and total == 3.0 * (1 << 20)
    buf = torch.empty(1 << 20)
    out = rdt.get(ref, into=buf, timeout=60)
    assert out.data_ptr() == buf.data_ptr() and checksum(buf) == 3.0 * (1 << 20)


def test_views_share_one_registration_per_storage(producer):
    import gc

    # (Counted for `base`'s storage alone: the earlier tests' registrations go after a
    # linger, and one that went between two counts of all of them failed this test.)
    gc.collect()  # the earlier tests' refs (some in cycles) go first
    wait_until(lambda: ray.get(producer.base_registrations.remote()) == 0, 30)
    refs = [producer.views.remote() for _ in range(3)]
    got = rdt.get(refs[0], timeout=60)
    assert torch.equal(got[1], torch.arange(100, 300, dtype=torch.float32))
    assert ray.get(producer.base_registrations.remote()) == 1  # three objects of three views each: one
    del refs
    wait_until(lambda: ray.get(producer.base_registrations.remote()) == 0, 30)


def test_cancel_mid_read_releases_and_fetch_again_works(producer, consumer):
    ref = producer.big.remote(16 << 20)  # 64 MB
    first, total = ray.get(consumer.cancel_then_fetch.remote([ref]))
    assert first in ("cancelled", "done") and total == 3.0 * (16 << 20)
    assert ray.get(consumer.state.remote())["registrations"] == 0


def test_lifetime_goes_back_to_zero_with_no_registrations(producer, consumer):
    refs = [producer.make.remote(2000, seed=i) for i in range(5)]
    ray.get(consumer.fetch_all.remote(refs))
    state = ray.get(producer.state.remote())
    assert state["objects"] >= 5 and state["registrations"] >= 5
    del refs
    wait_until(lambda: ray.get(producer.state.remote())["objects"] == 0, 10)
    wait_until(lambda: ray.get(producer.state.remote())["registrations"] == 0, 10)
    assert ray.get(producer.state.remote())["registered_bytes"] == 0
    assert ray.get(consumer.state.remote())["registrations"] == 0


def test_fetch_after_free_raises_object_freed(producer):
    ref = producer.make.remote(100)
    obj = ray.get(ref)
    rdt.free(obj)
    with pytest.raises(rdt.ObjectFreedError):
        rdt.get(obj, timeout=60)


def test_idle_agent_burns_no_cpu(producer):
    ref = producer.big.remote(1 << 20)
    assert checksum(rdt.get(ref, timeout=60)) == 3.0 * (1 << 20)  # agent up, poller running
    t0 = cpu_seconds()
    idle = producer.idle_cpu.remote(1.0)  # the producer's 1 s and the driver's overlap: each counts its own
    time.sleep(1.0)
    driver = cpu_seconds() - t0
    used = ray.get(idle)
    assert used < 0.1, f"idle producer used {used:.3f} s of CPU in 1 s"
    assert driver < 0.2, f"the driver (its consumer agent) used {driver:.3f} s of CPU in 1 s"


def test_killed_producer_fails_fast():
    p = NixlProducer.remote()
    warm = rdt.get(p.make.remote(10), timeout=60)  # connected before the kill
    assert warm["step"] == 0
    refs = [p.make.remote(100, seed=1), p.big.remote(1 << 16)]
    ray.wait(refs, num_returns=2)
    ray.kill(p)
    time.sleep(0.5)
    for ref in refs:
        t0 = time.monotonic()
        with pytest.raises((rdt.PeerDiedError, rdt.ObjectFreedError)):
            rdt.get(ref, timeout=30)
        assert time.monotonic() - t0 < 10


def rdma_costs(tmp_path) -> str:
    """A cost table that says NIXL reads other nodes' CPU objects fastest (an RDMA
    network's; over the TCP of these hosts tcp is faster, and auto takes it)."""
    path = tmp_path / "rdma-costs.json"
    path.write_text(json.dumps({"cpu": {"nixl/hosts": [0.001, 20.0]}}))
    return str(path)


def nixl_costs(tmp_path) -> dict:
    """Actor options whose cost table is `rdma_costs`'s from their start."""
    return {"runtime_env": {"env_vars": {"RDT_AUTO_COSTS": rdma_costs(tmp_path)}}}


@pytest.mark.parametrize("rdma", [True, False])
def test_auto_reads_big_cpu_objects_across_nodes_over_what_the_costs_say(rdma, tmp_path, producer, far_reader):
    costs = rdma_costs(tmp_path) if rdma else ""
    ray.get([producer.use_costs.remote(costs), far_reader.use_costs.remote(costs)])
    try:
        wait_until(lambda: ray.get(producer.state.remote())["registrations"] == 0, 30)  # (what earlier tests made)
        _auto_reads_over_what_the_costs_say(rdma, producer, far_reader)
    finally:
        ray.get([producer.use_costs.remote(""), far_reader.use_costs.remote("")])


def _auto_reads_over_what_the_costs_say(rdma: bool, producer, reader) -> None:
    before = ray.get(reader.stats.remote())["fetches"]
    ref = producer.auto.remote(1 << 19)  # held to the end: its registration goes with its free
    assert ray.get(reader.checksums.remote(ref)) == [2.0 * (1 << 19)]
    stats = ray.get(reader.stats.remote())
    picked = "nixl" if rdma else "tcp"
    assert {k: n - before.get(k, 0) for k, n in stats["fetches"].items() if n != before.get(k, 0)} == {picked: 1}
    choice = stats["auto"][-1]  # and why: the cost model ranked what both ends can use
    assert choice["transport"] == picked
    # NIXL is prepared only where it can win: its agent and registration cost the producer
    assert set(choice["estimates_ms"]) == ({"nixl", "tcp", "object_store"} if rdma else {"tcp", "object_store"})
    assert choice["why"].startswith(f"2 MiB CPU from another node: {picked} "), choice["why"]
    assert ray.get(producer.state.remote())["registrations"] == (1 if rdma else 0)
    del ref


@rdt.remote
class StallingReader:
    """A consumer whose NIXL leaves every READ in progress for good (ai-dynamo/nixl#2047),
    emulated as the contract suite does: each READ is done, but NIXL says it is in progress."""

    def __init__(self) -> None:
        self.said: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("rdt_async").addHandler(handler)

    async def stall_every_read(self, costs: str) -> None:
        from rdt_async.transports.nixl import _transport, _xfer

        use_costs(costs)
        _xfer.STALL_S, _xfer.ABORT_GRACE_S, _transport.RECHECK_S = 1.0, 0.5, 1.0  # (30, 5 and 5 s)
        self.stalling = nixl_stalling(_registry.transport("nixl").agent().nixl, until_removed=None)
        self.stalling.__enter__()  # for the actor's life

    async def read(self, refs, tensor_transport=None):
        before = dict(rdt.store_stats()["fetches"])
        try:
            sums = [checksum(await rdt.fetch(r, tensor_transport=tensor_transport)) for r in refs]
        except rdt.RDTError as exc:
            sums = [f"{type(exc).__name__}: {exc}"]
        used = {k: n - before.get(k, 0) for k, n in rdt.store_stats()["fetches"].items() if n != before.get(k, 0)}
        return sums, used, rdt.store_stats()["auto"][-len(refs):], list(self.said)


def test_auto_takes_another_path_where_every_nixl_read_from_a_producer_stalls(tmp_path, producer):
    """auto reads other nodes' CPU objects over nixl (an RDMA network's costs); where
    NIXL leaves every READ in progress, the first is cut off at its bound, the liveness
    check over a fresh connection stalls too, and the fetch goes on over tcp, says why
    once, and leaves nixl out for that producer. A fetch that names nixl fails, naming the bound."""
    costs = rdma_costs(tmp_path)
    reader = StallingReader.options(**ON_NODE2).remote()
    ray.get([producer.use_costs.remote(costs), reader.stall_every_read.remote(costs)])
    try:
        _auto_takes_another_path(producer, reader)
    finally:
        ray.kill(reader)
        ray.get(producer.use_costs.remote(""))


def _auto_takes_another_path(producer, reader) -> None:
    n = 1 << 19  # 2 MiB: read from the I/O loop, bounded by STALL_S
    sums, used, choices, said = ray.get(reader.read.remote([producer.auto.remote(n), producer.auto.remote(n)]), timeout=120)
    assert sums == [2.0 * n] * 2 and used == {"tcp": 2}, (sums, used)
    first, second = choices
    assert first["transport"] == "tcp" and [f["transport"] for f in first["fell_back"]] == ["nixl"], first
    assert "nixl READs from" in first["fell_back"][0]["why"] and "none ended over a fresh connection" in first["fell_back"][0]["why"]
    assert second["transport"] == "tcp" and "nixl left out: could not reach that node lately" in second["why"], second
    assert len([s for s in said if "auto could not use nixl" in s]) == 1, said
    sums, used, _, _ = ray.get(reader.read.remote([producer.auto.remote(n)], "nixl"), timeout=120)
    assert sums[0].startswith("ReadStalled: nixl READ of") and "RDT_NIXL_STALL_S" in sums[0], sums
    assert used == {}, used


@rdt.remote
class FreshAsyncConsumer(Probed):
    """An async actor that has fetched nothing yet, with a probe on its loop."""

    async def fetch_probed(self, refs) -> tuple[float, float, str]:
        self.probe.start()
        value = await rdt.fetch(refs[0])
        lag = await self.probe.stop()
        return lag, checksum(value), rdt.store_stats()["auto"][-1]["transport"]


@pytest.mark.parametrize("warm", ["1", "0"])
def test_first_auto_transfer_across_nodes_and_the_actors_loops(warm, tmp_path):
    # Loading NIXL holds the GIL ~0.4 s: an actor that first meets it at its first auto
    # object or fetch stalls its loop. rdt.remote actors of a cluster of several nodes
    # load it at creation, before their loop serves (RDT_WARM_NIXL=1 forces that here,
    # where UCXX is installed too and the default leaves NIXL unloaded; =0 shows the stall).
    env = nixl_costs(tmp_path)  # where auto reads CPU objects of other nodes over NIXL
    env["runtime_env"]["env_vars"]["RDT_WARM_NIXL"] = warm
    producer = FreshAutoProducer.options(**env).remote()
    reader = FreshAsyncConsumer.options(**env, **ON_NODE2).remote()
    def nixl_loaded() -> list[bool]:
        return ray.get([a.__ray_call__.remote(lambda self: "nixl._api" in sys.modules) for a in (producer, reader)])

    ray.get(producer.start_probe.remote())
    assert nixl_loaded() == [warm == "1"] * 2  # loaded at creation, or left for the first use
    lag, total, picked = ray.get(reader.fetch_probed.remote([producer.auto.remote(1 << 19)]))
    assert (total, picked) == (2.0 * (1 << 19), "nixl")
    made_lag, made_report = ray.get(producer.stop_probe.remote())
    assert nixl_loaded() == [True, True]
    ray.kill(reader)
    ray.kill(producer)
    if warm == "1":  # (without the warm-up, loading NIXL holds each loop 50-400 ms at first use)
        assert lag < 0.1, f"the consumer's loop stalled {lag * 1000:.0f} ms at its first fetch over nixl"
        assert made_lag < 0.1, f"the producer's first auto object: {made_report}"


@pytest.mark.parametrize(
    "setting, several, packages, beats, gpus, warms",
    [
        ("", True, {"nixl"}, True, False, True),  # where auto reads other nodes' CPU objects over nixl
        ("", True, {"nixl"}, False, False, False),  # where tcp reads them faster (TCP networks)
        ("", True, {"nixl"}, False, True, True),  # GPU objects of other nodes: nixl
        ("", False, {"nixl"}, True, True, False),  # one node: shared memory, cuda_ipc
        ("", True, {"nixl", "ucxx"}, True, True, False),  # NIXL would keep UCXX's UCX out of the process
        ("", True, set(), True, True, False),
        ("1", False, {"nixl", "ucxx"}, False, False, True),
        ("0", True, {"nixl"}, True, True, False),
    ],
)
def test_which_actors_load_nixl_at_creation(monkeypatch, tmp_path, setting, several, packages, beats, gpus, warms):
    # Asked of the transports (`warm_at_creation`, auto's costs), not decided by name.
    from rdt_async import _produce
    from rdt_async.transports.nixl import _transport

    monkeypatch.setenv("RDT_WARM_NIXL", setting)
    monkeypatch.setattr(_produce._ray, "several_nodes", lambda: several)
    monkeypatch.setattr(_transport, "_installed", lambda name: name in packages)
    if beats:  # an RDMA network's costs, measured: NIXL reads other nodes' big CPU objects faster than tcp
        (tmp_path / "costs.json").write_text('{"cpu": {"nixl/hosts": [0.006, 10.0]}}')
        monkeypatch.setenv("RDT_AUTO_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setattr(_produce, "_gpus_here", lambda: gpus)
    assert _produce.at_creation(["auto", "shm"]) == (["shm", "nixl"] if warms else ["shm"])


AGENT_STARTS = (
    "from rdt_async.transports import _registry\n"
    "t = _registry.transport('nixl'); t.warm_up(); print('agent', t.agent().name)\n"
)


def run_python(code: str, nixl_log_level: str = "") -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose NIXL_LOG_LEVEL is `nixl_log_level` (unset: "")."""
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if nixl_log_level:
        env["NIXL_LOG_LEVEL"] = nixl_log_level
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def one_node_then_agent() -> subprocess.CompletedProcess:
    """One interpreter (each costs ~2 CPU-s): a big CPU object planned for `auto` on one
    node, what that loaded; then a NIXL agent started at NIXL's default log level."""
    return run_python(
        "import sys, torch\n"
        "from rdt_async import _produce, _ray\n"
        "_ray.several_nodes = lambda: False\n"
        "plan = _produce._prepared_transports('auto', [torch.ones(1 << 20)])\n"
        "print([t.name for t in plan], 'nixl' in sys.modules)\n" + AGENT_STARTS
    )


def test_auto_on_one_node_never_loads_nixl(one_node_then_agent):
    # Loading NIXL holds the GIL ~0.2-0.4 s: a big CPU object on a one-node cluster
    # (shared memory's case) must not pay it at its first export.
    out = one_node_then_agent
    assert out.stdout.split("agent rdt-")[0].strip() == "['shm'] False", out.stderr  # (what the plan printed)


def test_without_nixl_installed_the_error_names_the_extra():
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import torch, rdt_async as rdt\n"
        "print(rdt.available_transports()['nixl'])\n"
        "try:\n"
        "    rdt.put(torch.ones(3), tensor_transport='nixl')\n"
        "except rdt.TransportUnavailableError as e:\n"
        "    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stderr
    assert "pip install 'rdt_async[nixl]'" in lines[0]
    assert lines[1].startswith("raised transport 'nixl' is unavailable") and "rdt_async[nixl]" in lines[1]


@pytest.mark.parametrize("level", ["", "INFO"])
def test_an_agent_starting_prints_nothing_unless_nixl_log_level_asks(level, request):
    # NIXL logs at INFO to stdout by default; a program's stdout is its own.
    out = run_python(AGENT_STARTS, level) if level else request.getfixturevalue("one_node_then_agent")
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("agent rdt-"), out.stderr
    nixl_lines = [line for line in lines if "NIXL INFO" in line]
    assert (len(nixl_lines) >= 1) == bool(level), lines


def test_fresh_reads_reuse_dropped_buffers_with_their_registrations(producer, consumer):
    # Each value is dropped before the next fetch, so its buffer (and the address NIXL
    # registered) is reused while the previous registration may still be going away.
    n = 1 << 20
    refs = [producer.big.remote(n + (i % 2)) for i in range(12)]
    sums, distinct = ray.get(consumer.fetch_each_dropping.remote(refs))
    assert sums == [3.0 * (n + (i % 2)) for i in range(12)]
    assert distinct < 12  # buffers came back for reuse
    wait_until(lambda: ray.get(consumer.state.remote())["registrations"] == 0, 10)


def test_first_nixl_object_of_an_async_producer_keeps_its_loop_free():
    p = FreshAsyncProducer.remote()
    ray.get(p.start_probe.remote())
    ref = p.make.remote(100)
    ray.wait([ref])
    lag, report = ray.get(p.stop_probe.remote())
    assert lag < 0.2, f"while the producer's agent was made: {report}"
    assert checksum(rdt.get(ref, timeout=60)) == 200.0
    ray.kill(p)


def test_small_reads_from_this_host_are_done_on_the_callers_thread(producer):
    rdt.get(producer.make.remote(10), timeout=60)  # connected: the first read goes through the I/O loop
    small = [producer.make.remote(1000, seed=i) for i in range(3)]
    large = producer.big.remote(1 << 16)  # 256 KiB: above BOUNCE_BYTES, the I/O loop's job
    ray.wait([*small, large], num_returns=4)
    blocked = _io.start(asyncio.to_thread(time.sleep, 0))  # warm the loop's default executor
    blocked.result(10)

    async def block_the_loop() -> None:
        time.sleep(1.5)

    blocked = _io.start(block_the_loop())
    time.sleep(0.05)
    t0 = time.monotonic()
    for i, ref in enumerate(small):
        assert_same(rdt.get(ref, timeout=60), make_value(1000, i))
    buf = torch.zeros(12, dtype=torch.int32).reshape(3, 4).t()  # strided: copied into
    got = rdt.get(small[0], into=[torch.empty(1000), torch.empty(500), buf, torch.empty(7, dtype=torch.bfloat16),
                                  torch.empty(2, dtype=torch.bool), torch.empty(0)], timeout=60)
    took = time.monotonic() - t0
    assert not blocked.done(), "the loop was not blocked while the small reads ran"
    assert took < 1.0, f"small reads waited {took:.2f} s for the blocked I/O loop"
    assert torch.equal(got["pair"][1], buf) and torch.equal(buf, torch.arange(12, dtype=torch.int32).reshape(3, 4).t())
    assert checksum(rdt.get(large, timeout=60)) == 3.0 * (1 << 16)  # after the loop is free again
    assert _registry.transport("nixl").registrations == 0  # small reads land in the bounce buffer


def test_objects_over_storages_read_before_keep_reading_right(producer, consumer):
    # The metadata of a storage is loaded once per consumer; objects over storages read
    # earlier skip it. Interleave two storages, in the driver and in an async actor.
    refs = [producer.kept.remote("ab"[i % 2]) for i in range(8)]
    want = {"a": torch.arange(1000, dtype=torch.int64), "b": torch.linspace(-1, 1, 3000, dtype=torch.float64)}
    for i, ref in enumerate(refs + refs[::-1]):
        got = rdt.get(ref, timeout=60)
        assert_same(got["w"], want[got["which"]])
        assert got["which"] == "ab"[(i if i < 8 else 15 - i) % 2]
    sums = ray.get(consumer.checksums.remote(*refs))  # (the module's consumer has read neither storage)
    assert sums == [checksum(want["ab"[i % 2]]) for i in range(8)]


def test_a_small_read_nixl_leaves_in_progress_is_finished_on_the_loop(producer, monkeypatch):
    t = _registry.transport("nixl")
    assert checksum(rdt.get(producer.big.remote(100), timeout=60)) == 300.0  # connected
    nx = t.agent().nixl
    real_check, until = nx.check_xfer_state, time.monotonic() + 0.05
    monkeypatch.setattr(nx, "transfer", lambda h, *a: (type(nx).transfer(nx, h, *a), "PROC")[1])
    monkeypatch.setattr(nx, "check_xfer_state", lambda h: "PROC" if time.monotonic() < until else real_check(h))
    ref = producer.make.remote(1000, seed=5)
    ray.wait([ref])
    until = time.monotonic() + 0.05
    assert_same(rdt.get(ref, timeout=60), make_value(1000, 5))
    monkeypatch.undo()
    scratch = t._current().scratch
    wait_until(lambda: scratch.bounce.free == _scratch.BOUNCE_CHUNKS, 10, lambda: f"bounce {scratch.bounce.free} landing {scratch.landing.free}")
    wait_until(lambda: scratch.landing.free == _scratch.LANDING_SLOTS, 10)


@rdt.remote(max_concurrency=8)
class ThreadedReader:
    """A threaded actor: its threads read small nixl objects at the same time."""

    def read(self, refs, seed0: int):
        sums = []
        for i, r in enumerate(refs):
            value = rdt.get(r, timeout=60)
            sums.append(checksum(value["w"]) == checksum(make_value(300, seed0 + i)["w"]) and value["step"] == seed0 + i)
        return all(sums)

    def free_bounce(self) -> int:
        return _registry.transport("nixl")._current().scratch.bounce.free


def test_threads_of_one_actor_read_small_objects_at_once(producer):
    reader = ThreadedReader.remote()
    batches = [[producer.make.remote(300, seed=100 * b + i) for i in range(25)] for b in range(8)]
    assert ray.get([reader.read.remote(refs, 100 * b) for b, refs in enumerate(batches)]) == [True] * 8
    assert ray.get(reader.free_bounce.remote()) == _scratch.BOUNCE_CHUNKS
    ray.kill(reader)
