"""Bring your own transport: rdt.Transport subclasses, Ray TensorTransportManager ones, entry points.

Two one-sided transports move files through a spool directory: the docs' example
(`examples/custom_transport.py`, written against `rdt.Transport`) and `SpoolManager`,
written against Ray's `TensorTransportManager` and run through the adapter. Both are
registered at import, before Ray is initialized, like a script would.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from conftest import wait_until
from helpers import FetchesWithTimeout, manager_base
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

import rdt_async as rdt
from rdt_async.testing import MockTransport

pytestmark = pytest.mark.usefixtures("ray_session")

REPO = Path(__file__).resolve().parents[1]
# Named, not made: the transports make their folders under it as they spool, and the fixture
# below removes it. (Made at import, a test worker that only collected this module left it.)
SPOOL = os.path.join(tempfile.gettempdir(), f"rdt-custom-transport-{os.getpid()}-{os.urandom(4).hex()}")


def _load_example():
    path = REPO / "examples" / "custom_transport.py"
    spec = importlib.util.spec_from_file_location("custom_transport", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _load_example()  # registers "spool", as the script does


class FileSpool(example.SpoolTransport):
    """The example's transport, in this test's spool directory."""

    root = os.path.join(SPOOL, "transport")


class SlowFileSpool(FileSpool):
    """Waits a minute before reading; leaves a mark when its receive is cancelled."""

    async def receive(self, info, buffers, channel):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            Path(self.root, f"cancelled-{info.obj_id}").touch()
            raise
        return await super().receive(info, buffers, channel)


@dataclass
class SpoolManagerMeta(TensorTransportMetadata):
    path: str = ""
    pid: int = 0


class SpoolManager(manager_base("SPOOL", can_abort=True)):
    """The same spool, written for Ray: synchronous, one-sided, abortable."""

    root = os.path.join(SPOOL, "manager")
    slow = False

    def __init__(self):
        self.aborted: set[str] = set()

    def extract_tensor_transport_metadata(self, obj_id, rdt_object):
        folder = os.path.join(self.root, str(os.getpid()))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{obj_id}.pt")
        torch.save([t.clone() for t in rdt_object], path)
        return SpoolManagerMeta([(t.shape, t.dtype) for t in rdt_object], "cpu", path, os.getpid())

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        if src_actor is None:
            raise ValueError("the producer's actor did not travel with the object")
        return CommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata,
                              target_buffers=None):
        deadline = time.monotonic() + 60
        while self.slow and obj_id not in self.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        if obj_id in self.aborted:
            raise RuntimeError(f"transfer of {obj_id} aborted")
        os.kill(tensor_transport_metadata.pid, 0)  # ProcessLookupError: the producer died
        tensors = torch.load(tensor_transport_metadata.path)
        if target_buffers is None:
            return tensors
        return [b.copy_(t) for b, t in zip(target_buffers, tensors)]

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError("one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        shapes = [tuple(shape) for shape, _ in tensor_transport_meta.tensor_meta]
        assert [tuple(t.shape) for t in tensors] == shapes  # Ray's contract: the object's tensors
        os.unlink(tensor_transport_meta.path)

    def abort_transport(self, obj_id, communicator_metadata):
        self.aborted.add(obj_id)
        Path(self.root, f"aborted-{obj_id}").touch()


class SlowSpoolManager(SpoolManager):
    slow = True


class LateManager(SpoolManager):
    """Cannot abort: its receive writes the buffers it is given a second later, whatever
    happened to the fetch meanwhile."""

    @staticmethod
    def can_abort_transport():
        return False

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None):
        time.sleep(1.0)
        return super().recv_multiple_tensors(obj_id, tensor_transport_metadata, communicator_metadata, target_buffers)


@dataclass
class DropComm(CommunicatorMetadata):
    token: str = ""


class DropManager(manager_base("DROP", one_sided=False)):
    """Two-sided, written for Ray: the producer's send drops the tensors in a file named
    by the communicator metadata; the consumer's receive waits for it."""

    root = os.path.join(SPOOL, "drop")

    def extract_tensor_transport_metadata(self, obj_id, rdt_object):
        os.makedirs(self.root, exist_ok=True)
        Path(self.root, f"held-{obj_id}-{secrets.token_hex(4)}").touch()
        return TensorTransportMetadata([(t.shape, t.dtype) for t in rdt_object], "cpu")

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return DropComm(token=secrets.token_hex(8))

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        path = os.path.join(self.root, f"drop-{communicator_metadata.token}.pt")
        torch.save([t.clone() for t in tensors], path + ".part")
        os.rename(path + ".part", path)

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata,
                              target_buffers=None):
        path = os.path.join(self.root, f"drop-{communicator_metadata.token}.pt")
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        tensors = torch.load(path)
        os.unlink(path)
        assert [(t.shape, t.dtype) for t in tensors] == list(tensor_transport_metadata.tensor_meta)
        return tensors

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        for p in Path(self.root).glob(f"held-{obj_id}-*"):
            p.unlink()
            return

    def abort_transport(self, obj_id, communicator_metadata):
        raise AssertionError("never called: can_abort_transport() is False")


rdt.register_transport("file-spool", ["cpu"], FileSpool)
rdt.register_transport("file-spool-slow", ["cpu"], SlowFileSpool)
rdt.register_transport("manager-spool", ["cpu"], SpoolManager)
rdt.register_transport("manager-spool-slow", ["cpu"], SlowSpoolManager)
rdt.register_transport("manager-drop", ["cpu"], DropManager)
rdt.register_transport("manager-late", ["cpu"], LateManager)
ROOTS = {"file-spool": FileSpool.root, "manager-spool": SpoolManager.root}
TRANSPORTS = list(ROOTS)


def nested(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, generator=g),
        "step": seed,
        "layers": [torch.arange(6).reshape(2, 3) * seed, (torch.ones(3, dtype=torch.bfloat16), "tag")],
        "empty": torch.empty(0),
    }


def assert_same(got, want):
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


@rdt.remote
class SyncMaker:
    @rdt.method(tensor_transport="file-spool")
    def file_spool(self, seed):
        return nested(seed)

    @rdt.method(tensor_transport="manager-spool")
    def manager_spool(self, seed):
        return nested(seed)

    @rdt.method(tensor_transport="file-spool-slow")
    def file_spool_slow(self, seed):
        return nested(seed)

    @rdt.method(tensor_transport="manager-spool-slow")
    def manager_spool_slow(self, seed):
        return nested(seed)

    def put(self, seed, transport):
        return [rdt.put(nested(seed), tensor_transport=transport)]

    def knows(self, name):
        return name in rdt.available_transports()

    def stats(self):
        return rdt.store_stats()

    def pid(self):
        return os.getpid()


def test_a_node_local_transport_is_read_through_the_object_store_from_another_node(monkeypatch, makers):
    """The example says `reach = "node"` (its files are this node's): the core honours it as it
    does shm's. A consumer on another node fetches through the object store, and the node relay
    never relays the spool; a transport that declares nothing reaches the cluster."""
    from rdt_async import _choose, _ray, _relay

    maker = makers["sync"]
    pid = ray.get(maker.pid.remote())
    ref = maker.file_spool.remote(11)
    obj = ray.get(ref)  # the RDTObject itself
    assert _choose.choose_transport(obj, _ray.node_id())[0] == "file-spool"
    assert _choose.choose_transport(obj, "e" * 56) == ("object_store", None)
    monkeypatch.setattr(_ray, "node_id", lambda: "e" * 56)  # this driver, as if on another node
    before = rdt.store_stats()["fetches"].get("object_store", 0)
    assert_same(rdt.get(ref, timeout=60), nested(11))
    assert rdt.store_stats()["fetches"].get("object_store", 0) == before + 1
    mib = [rdt.TensorSpec((1 << 18,), torch.float32, "cpu", 1 << 20)]
    assert not _relay.eligible(mib, "file-spool", "node-a", "node-b")
    assert _relay.eligible(mib, "manager-spool", "node-a", "node-b")  # (declares no reach)
    del ref, obj  # the module's maker is left as it was found
    wait_until(lambda: objects_of(maker) == 0, 15)
    wait_until(lambda: not files_of("file-spool", pid), 15, lambda: f"left: {files_of('file-spool', pid)}")


# A transport of yours that declares shm's powers, and a lower cost than shm's, for objects of
# one size only (every other object of this session keeps shm): `auto` takes it there.
AUTO_SPOOL_BYTES = 4 * 250_007


class AutoSpool(FileSpool):
    auto_prepares = True
    auto_min_bytes = auto_max_bytes = AUTO_SPOOL_BYTES
    auto_costs = {"cpu/node": rdt.Cost(0.0001, 100.0)}


@rdt.remote
class AutoMaker:
    def put(self, n):
        return [rdt.put(torch.arange(n, dtype=torch.float32), tensor_transport="auto")]

    def stats(self):
        return rdt.store_stats()

    def pid(self):
        return os.getpid()


def test_auto_prepares_a_transport_of_yours_and_consumers_take_it_where_it_declares_itself_cheapest(users):
    """The core asks a transport what it costs and reaches, never its name: a registered
    transport that says `auto_prepares` and costs less than shm on a node takes shm's place
    there, in a producer created after the registration and in a consumer created before it."""
    from rdt_async import _ray

    name = f"auto-spool-{secrets.token_hex(3)}"
    rdt.register_transport(name, ["cpu"], AutoSpool)
    maker, user = AutoMaker.remote(), users["async"]  # (the user listed the cluster's transports before)
    pid = ray.get(maker.pid.remote())
    n = AUTO_SPOOL_BYTES // 4
    [ref], [other] = ray.get(maker.put.remote(n)), ray.get(maker.put.remote(n + 1))
    to_others = {"tcp"} if _ray.several_nodes() else set()  # (the test cluster's other hosts)
    assert set(ray.get(ref).meta) - {"groups"} == {name, *to_others}  # not shm: it declared itself cheaper
    assert set(ray.get(other).meta) - {"groups"} == {"shm", *to_others}  # outside its sizes
    time.sleep(1.1)  # (a process lists the cluster's new transports at most once a second)
    assert torch.equal(ray.get(user.fetch.remote([ref])), torch.arange(n, dtype=torch.float32))
    assert ray.get(user.fetches.remote()).get(name) == 1  # (not the object store)
    before = rdt.store_stats()
    assert torch.equal(rdt.get(other, timeout=60), torch.arange(n + 1, dtype=torch.float32))
    assert torch.equal(rdt.get(ref, timeout=60), torch.arange(n, dtype=torch.float32))
    after = rdt.store_stats()
    assert after["fetches"].get(name, 0) == before["fetches"].get(name, 0) + 1
    assert after["fetches"].get("shm", 0) == before["fetches"].get("shm", 0) + 1
    assert after["auto"][-1]["transport"] == name, after["auto"]
    assert len(files_of("file-spool", pid)) == 1  # the spool holds that one object
    del ref, other
    wait_until(lambda: not files_of("file-spool", pid), 15, lambda: f"left: {files_of('file-spool', pid)}")
    ray.kill(maker)


@rdt.remote
class AsyncMaker:
    @rdt.method(tensor_transport="file-spool")
    async def file_spool(self, seed):
        return nested(seed)

    @rdt.method(tensor_transport="manager-spool")
    async def manager_spool(self, seed):
        return nested(seed)

    async def put(self, seed, transport):
        return [rdt.put(nested(seed), tensor_transport=transport)]

    async def stats(self):
        return rdt.store_stats()

    async def pid(self):
        return os.getpid()

    async def run(self, name, seed, user):
        """Drive actors of its own, from its own process: a new producer, and `user`."""
        maker = Maker.remote()
        [ref] = await maker.put.remote(seed, name)
        here, there = await rdt.fetch(ref), await user.fetch.remote([ref])
        ray.kill(maker)
        return here, there


@rdt.remote
class Maker:
    """Knows no transport in particular: puts values with the one it is told."""

    def put(self, seed, transport):
        return [rdt.put(nested(seed), tensor_transport=transport)]

    def knows(self, name):
        return name in rdt.available_transports()

    def stats(self):
        return rdt.store_stats()


@rdt.remote
class AsyncUser(FetchesWithTimeout):
    async def take(self, value):
        return value

    async def fetch(self, refs):
        return await rdt.fetch(refs[0])

    async def fetch_all(self, refs):
        return await rdt.fetch_all(refs)

    async def ping(self):
        return "pong"

    async def fetches(self):
        return rdt.store_stats()["fetches"]


@rdt.remote
class SyncUser:
    def take(self, value):
        return value

    def get(self, refs):
        return rdt.get(refs[0])


@pytest.fixture(scope="module", autouse=True)
def spool_dir():
    yield SPOOL
    shutil.rmtree(SPOOL, ignore_errors=True)


@pytest.fixture(scope="module")
def makers():
    actors = {"sync": SyncMaker.remote(), "async": AsyncMaker.remote()}
    yield actors
    for a in actors.values():
        ray.kill(a)


@pytest.fixture(scope="module")
def users():
    actors = {"async": AsyncUser.remote(), "sync": SyncUser.remote()}
    yield actors
    for a in actors.values():
        ray.kill(a)


def objects_of(actor) -> int:
    return ray.get(actor.stats.remote())["objects"]


def files_of(transport: str, pid: int) -> list[str]:
    if transport == "file-spool":  # (the example's layout: ROOT/PID-OBJ.pt)
        return [p.name for p in Path(ROOTS[transport]).glob(f"{pid}-*.pt")]
    folder = os.path.join(ROOTS[transport], str(pid))
    return os.listdir(folder) if os.path.isdir(folder) else []


def make(maker, transport: str, seed: int):
    return getattr(maker, transport.replace("-", "_")).remote(seed)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_values_travel_between_sync_and_async_actors_then_are_freed(transport, kind, makers, users):
    maker = makers[kind]
    pid = ray.get(maker.pid.remote())
    before = ray.get(users["async"].fetches.remote()).get(transport, 0)
    refs = [make(maker, transport, seed) for seed in (1, 2, 3)]
    assert_same(ray.get(users["async"].take.remote(refs[0])), nested(1))  # auto-fetched argument
    assert_same(ray.get(users["sync"].take.remote(refs[1])), nested(2))
    assert_same(ray.get(users["async"].fetch.remote([refs[2]])), nested(3))
    assert_same(ray.get(users["sync"].get.remote([refs[0]])), nested(1))
    assert_same(rdt.get(refs[1]), nested(2))  # the driver
    got = ray.get(users["async"].fetch_all.remote(refs))
    for seed, value in zip((1, 2, 3), got):
        assert_same(value, nested(seed))
    assert ray.get(users["async"].fetches.remote())[transport] == before + 5
    assert len(files_of(transport, pid)) == 3
    del refs, got
    wait_until(lambda: objects_of(maker) == 0, 15)
    # the transport's garbage_collect ran: it is what deletes the files
    wait_until(lambda: not files_of(transport, pid), 15, lambda: f"left: {files_of(transport, pid)}")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_two_sided_manager_sends_while_the_consumer_receives(kind, makers, users):
    maker = makers[kind]
    refs = [ray.get(maker.put.remote(seed, "manager-drop"))[0] for seed in (11, 12)]
    assert_same(ray.get(users["async"].fetch.remote([refs[0]])), nested(11))
    assert_same(ray.get(users["sync"].take.remote(refs[1])), nested(12))
    got = ray.get(users["async"].fetch_all.remote(refs))
    assert_same(got, [nested(11), nested(12)])
    assert not list(Path(DropManager.root).glob("drop-*"))
    del refs
    wait_until(lambda: objects_of(maker) == 0, 15)
    # metadata extracted when the value was returned is given back with the object
    wait_until(lambda: not list(Path(DropManager.root).glob("held-*")), 15)


def test_into_receives_into_caller_buffers(makers):
    ref = make(makers["sync"], "manager-spool", 4)
    want = nested(4)
    into = [torch.empty(64), torch.empty(2, 3, dtype=torch.int64)]
    into += [torch.empty(3, dtype=torch.bfloat16), torch.empty(0)]
    got = rdt.get(ref, into=into)
    assert got["w"].data_ptr() == into[0].data_ptr()
    assert_same(got, want)


def test_a_manager_that_cannot_abort_never_writes_into_buffers_after_the_fetch_ended(makers):
    # Ray's managers receive in a pool thread that an abort may not stop (or not within
    # rdt_async's bound): into the caller's buffers, it wrote them after the fetch raised,
    # where another fetch (or the caller) may have written them since.
    [ref] = ray.get(makers["sync"].put.remote(10, "manager-late"))
    into = [torch.full((64,), -1.0), torch.full((2, 3), -1, dtype=torch.int64)]
    into += [torch.full((3,), -1.0, dtype=torch.bfloat16), torch.empty(0)]
    with pytest.raises(TimeoutError):
        rdt.get(ref, into=into, timeout=0.3)
    time.sleep(1.5)  # the receive has ended by now
    assert all(bool((b == -1).all()) for b in into[:3]), "written after the fetch ended"
    got = rdt.get(ref, into=into, timeout=30)  # one that waits lands in them
    assert got["w"].data_ptr() == into[0].data_ptr()
    assert_same(got, nested(10))


@pytest.mark.parametrize(
    "transport, mark", [("file-spool-slow", "cancelled"), ("manager-spool-slow", "aborted")]
)
def test_cancelled_fetch_aborts_the_transfer(transport, mark, makers, users):
    maker, user = makers["sync"], users["async"]
    ref = make(maker, transport, 5)
    obj_id = ray.get(ref).obj_id
    root = SlowFileSpool.root if transport.startswith("file") else SlowSpoolManager.root
    t0 = time.monotonic()
    assert ray.get(user.fetch_with_timeout.remote([ref], 0.5)) == "timeout"
    assert time.monotonic() - t0 < 10
    wait_until(lambda: Path(root, f"{mark}-{obj_id}").exists(), 10)  # the transport saw the cancel
    assert ray.get(user.ping.remote()) == "pong"
    with pytest.raises(TimeoutError):
        rdt.get(ref, timeout=0.3)
    # the consumer's pool is free again: a normal fetch goes through
    assert_same(ray.get(user.fetch.remote([make(maker, transport.removesuffix("-slow"), 6)])), nested(6))
    del ref
    wait_until(lambda: objects_of(maker) == 0, 15)


def test_killed_producer_fails_the_fetch(users):
    maker = SyncMaker.remote()
    pid = ray.get(maker.pid.remote())
    refs = {t: make(maker, t, 7) for t in TRANSPORTS}
    ray.wait(list(refs.values()), num_returns=len(refs))
    ray.kill(maker)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 15)
    for transport, ref in refs.items():
        with pytest.raises(rdt.TransferError) as err:
            ray.get(users["async"].fetch.remote([ref]))
        if transport == "file-spool":  # the example says which error it is
            assert isinstance(err.value, rdt.PeerDiedError)
        with pytest.raises(rdt.TransferError):
            rdt.get(ref, timeout=30)
    assert ray.get(users["async"].ping.remote()) == "pong"


def test_registration_in_the_driver_reaches_actors_created_before(makers, users):
    maker, user = makers["sync"], users["async"]  # created by earlier tests
    coordinator = makers["async"]  # as well: it drives a producer it creates, and `user`
    name = f"late-spool-{secrets.token_hex(3)}"
    assert ray.get(maker.knows.remote(name)) is False
    rdt.register_transport(name, ["cpu"], SpoolManager)  # after the actors exist
    [ref] = ray.get(maker.put.remote(8, name))
    assert_same(ray.get(user.fetch.remote([ref])), nested(8))
    assert_same(rdt.get(ref), nested(8))
    assert ray.get(maker.knows.remote(name)) is True
    # an actor that creates a producer of its own and drives it and another actor
    here, there = ray.get(coordinator.run.remote(name, 9, user))
    assert_same(here, nested(9))
    assert_same(there, nested(9))
    del ref
    wait_until(lambda: objects_of(maker) == 0, 15)


def test_entry_point_transport_loads_lazily_and_reaches_actors(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(REPO / "tests" / "ep_pkg", site, ignore=shutil.ignore_patterns("__pycache__"))
    # importing rdt_async loads no entry point; the first lookup does
    code = (
        "import sys, rdt_async as rdt; assert 'rdt_ep_demo' not in sys.modules;"
        "a = rdt.available_transports(); assert a['ep-echo'] is True, a;"
        "assert 'rdt_ep_demo' in sys.modules; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr
    # an actor whose environment has the package produces with it by name
    path = os.pathsep.join([str(site), str(REPO / "tests")])
    maker = Maker.options(runtime_env={"env_vars": {"PYTHONPATH": path}}).remote()
    [ref] = ray.get(maker.put.remote(10, "ep-echo"))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        assert "ep-echo" in rdt.available_transports()
        assert_same(rdt.get(ref), nested(10))
    finally:
        sys.path.remove(str(site))
    del ref
    wait_until(lambda: objects_of(maker) == 0, 15)
    ray.kill(maker)


def test_registered_transports_are_listed():
    avail = rdt.available_transports()
    assert all(avail[name] is True for name in ("spool", "file-spool", "manager-spool"))
    rdt.register_transport("file-spool", ["cpu"], FileSpool)  # the same again: nothing to do


class _Receives(rdt.Transport):
    async def receive(self, info, buffers, channel):
        return []


class _NoReceive(rdt.Transport):
    pass


class _TwoSidedNoSend(_Receives):
    one_sided = False


class _SyncReceive(rdt.Transport):
    def receive(self, info, buffers, channel):
        return []


class _AsyncCollect(_Receives):
    async def garbage_collect(self, obj_id, meta):
        pass


class _HalfManager(TensorTransportManager):
    @staticmethod
    def is_one_sided():
        return True

    @staticmethod
    def can_abort_transport():
        return False


class _Locked(_Receives):
    lock = threading.Lock()


MANAGER_MISSING = (
    "missing extract_tensor_transport_metadata, garbage_collect, get_communicator_metadata, "
    r"recv_multiple_tensors \(abstract in TensorTransportManager\)$"
)
BAD_REGISTRATIONS = [
    ("x1", ["cpu"], FileSpool(), TypeError, "pass the class itself, not an instance"),
    ("x2", ["cpu"], 42, TypeError, "takes a transport class, not int"),
    ("x3", ["cpu"], dict, TypeError, "neither an rdt_async.Transport subclass nor .*TensorTransportManager"),
    ("x4", ["cpu"], _NoReceive, TypeError, "_NoReceive cannot be registered: .* async def receive"),
    ("x5", ["cpu"], _TwoSidedNoSend, TypeError, "missing async def send_multiple_tensors.*one_sided = False"),
    ("x6", ["cpu"], _SyncReceive, TypeError, "receive must be `async def`"),
    ("x7", ["cpu"], _AsyncCollect, TypeError, "garbage_collect must be a plain `def`"),
    ("x8", ["cpu"], _HalfManager, TypeError, MANAGER_MISSING),
    ("x9", [], _Receives, ValueError, "at least one device type"),
    ("x10", "cpu", _Receives, TypeError, r"list of device types such as \['cpu'\], not the string 'cpu'"),
    ("x11", ["gpu"], _Receives, ValueError, r"'gpu' is not a torch device type \(did you mean 'cuda'\?\)"),
    ("x12", ["cuda:0"], _Receives, ValueError, "device types such as 'cuda', not the device 'cuda:0'"),
    ("x13", ["cpu", "cuda"], FileSpool, ValueError, r"declares devices = \('cpu',\) and cannot handle cuda"),
    ("x14", [None], _Receives, TypeError, "device type names"),
    ("file-spool", ["cpu"], _Receives, ValueError, "'file-spool' is already registered to .*FileSpool"),
    ("a b", ["cpu"], _Receives, ValueError, "a transport name is 1-64 letters"),
    ("x15", ["cpu"], _Locked, TypeError, "_Locked cannot be pickled to reach other processes"),
]


@pytest.mark.parametrize("name, devices, cls, error, match", BAD_REGISTRATIONS)
def test_registration_errors_are_clear_and_immediate(name, devices, cls, error, match):
    with pytest.raises(error, match=match):
        rdt.register_transport(name, devices, cls)
    registered = rdt.available_transports()
    assert name not in registered or name == "file-spool"  # that one keeps its first class


@pytest.mark.parametrize("name", ["auto", "shm", "object_store", "nixl", "cuda_ipc", "ucxx", "gloo", "nccl", "NIXL"])
def test_built_in_names_cannot_be_shadowed(name):
    with pytest.raises(ValueError, match=f"{name!r} is the name of a built-in transport"):
        rdt.register_transport(name, ["cpu"], _Receives)


def test_an_unknown_name_in_a_method_names_register_transport():
    with pytest.raises(ValueError, match=re.escape("rdt.register_transport")):
        rdt.method(tensor_transport="never-registered")


class _LostOnFetch(MockTransport):
    """A user's failure injection: every fetch says the producer went away."""

    async def handle(self, info, tensors):
        raise rdt.PeerDiedError(f"injected: the producer of {info.obj_id} went away", obj_id=info.obj_id)


def test_mock_transport_and_a_failing_subclass_run_between_actors(makers, users):
    rdt.register_transport("mock", ["cpu"], MockTransport)  # by reference: rdt_async.testing
    rdt.register_transport("mock-lost", ["cpu"], _LostOnFetch)  # by value: defined in this module
    maker = makers["sync"]
    ref = ray.get(maker.put.remote(21, "mock"))[0]
    assert_same(ray.get(users["async"].fetch.remote([ref])), nested(21))
    assert ray.get(users["async"].fetches.remote())["mock"] >= 1
    del ref
    wait_until(lambda: objects_of(maker) == 0, 15)
    lost = ray.get(maker.put.remote(22, "mock-lost"))[0]
    with pytest.raises(rdt.PeerDiedError, match=r"injected: the producer of .* went away"):
        ray.get(users["async"].fetch.remote([lost]))
    assert ray.get(users["async"].ping.remote()) == "pong"
    del lost
    # freed without the consumer's garbage collector: the failure's frames let the object go
    wait_until(lambda: objects_of(maker) == 0, 15)


class _LandsWhereAsked(rdt.Transport):
    """Writes into caller buffers on any of its devices and notes where they were."""

    devices = ("cpu", "meta")
    cross_device_buffers = True
    seen: list = []

    async def receive(self, info, buffers, channel):
        type(self).seen.append(None if buffers is None else [str(b.device) for b in buffers])
        if buffers is None:
            return [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in info.specs]
        for i, b in enumerate(buffers):
            b.fill_(i + 1)
        return buffers


def test_device_reads_straight_into_that_device_where_the_transport_can():
    from rdt_async._object import Process, RDTObject
    from rdt_async._tree import flatten
    from rdt_async.transports._base import TensorSpec

    rdt.register_transport("lands-where-asked", ["cpu", "meta"], _LandsWhereAsked)
    held = [torch.empty(3, device="meta"), {"x": torch.empty(2, 2, dtype=torch.int64, device="meta")}]
    skeleton, tensors = flatten(held)
    obj = RDTObject(
        secrets.token_hex(12), Process(ray.get_runtime_context().get_node_id(), "1:elsewhere"),
        "lands-where-asked", tuple(TensorSpec.of(t) for t in tensors), skeleton,
        {"lands-where-asked": None}, {}, None,
    )
    _LandsWhereAsked.seen.clear()
    got = rdt.get(obj, device="cpu")
    assert _LandsWhereAsked.seen == [["cpu", "cpu"]]  # the transport wrote into CPU buffers itself
    assert torch.equal(got[0], torch.ones(3)) and torch.equal(got[1]["x"], torch.full((2, 2), 2))
    got = asyncio.run(rdt.fetch(obj, device="meta"))  # already there: no buffers, nothing moved
    assert _LandsWhereAsked.seen[-1] is None and got[0].device.type == "meta"


async def test_a_ray_manager_fetch_that_fails_before_its_transfer_gives_the_lent_metadata_back():
    """A two-sided manager's object that was not prepared: the producer makes metadata for
    the one transfer (_Describe) and holds it, with the tensors, until that transfer ends.
    A consumer that fails or is cancelled before the transfer starts must still give it
    back, also when its word arrives before the _Describe is served."""
    from rdt_async.transports import _ray_adapter as ra
    from rdt_async.transports._base import TensorSpec, TransferInfo

    class Lending:
        collected: list[str] = []

        def tensor_transport_backend(self):
            return "LEND"

        @staticmethod
        def is_one_sided():
            return False

        @staticmethod
        def can_abort_transport():
            return False

        def extract_tensor_transport_metadata(self, obj_id, tensors):
            return f"meta of {obj_id}"

        def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
            raise RuntimeError("no communicator between them")

        def garbage_collect(self, obj_id, meta, tensors):
            self.collected.append(obj_id)

    producer, consumer = ra.adapt("lend", ("cpu",), Lending)(), ra.adapt("lend", ("cpu",), Lending)()
    x = torch.ones(4)

    class Loopback:  # the consumer's requests, served by the producer's side in this process
        async def request_send(self, request):
            return await producer.send_multiple_tensors("o1", [x], None, request)

    info = TransferInfo("o1", (TensorSpec.of(x),), None)
    with pytest.raises(RuntimeError, match="no communicator between them"):
        await consumer.receive(info, None, Loopback())
    for _ in range(100):
        if Lending.collected:
            break
        await asyncio.sleep(0.02)
    assert Lending.collected == ["o1"] and not producer._lent

    # The abort overtakes the describe: the late describe lends nothing for good.
    await producer.send_multiple_tensors("o2", [x], None, ra._Abort(None, "t2"))
    await producer.send_multiple_tensors("o2", [x], None, ra._Describe("t2"))
    for _ in range(100):
        if len(Lending.collected) == 2:
            break
        await asyncio.sleep(0.02)
    assert Lending.collected == ["o1", "o2"] and not producer._lent and not producer._given_up


def test_the_examples_main_ends_its_actors_and_its_spool_files_when_a_call_fails(monkeypatch):
    """examples/custom_transport.py killed its actors only once every call had succeeded:
    a failing call (or the wait for the trainer to let go running out) left them, and a
    trainer's spool file, behind. Its `finally` ends both."""
    made = []

    class Recorded:  # one of the example's actor classes, each handle it makes kept here
        def __init__(self, cls):
            self.cls = cls

        def remote(self, *args, **kwargs):
            made.append(self.cls.remote(*args, **kwargs))
            return made[-1]

    @rdt.remote
    class DownServer:
        async def load(self, weights):
            raise RuntimeError("the server is down")

    spool = Path(example.SpoolTransport.root)
    before = set(spool.glob("*.pt")) if spool.is_dir() else set()
    monkeypatch.setattr(example, "Trainer", Recorded(example.Trainer))
    monkeypatch.setattr(example, "Server", Recorded(DownServer))
    with pytest.raises(ray.exceptions.RayTaskError, match="the server is down"):
        example.main()
    assert len(made) == 2
    for actor in made:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
    assert (set(spool.glob("*.pt")) if spool.is_dir() else set()) <= before
