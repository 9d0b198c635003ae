"""The fetch pipeline's own checks and bookkeeping, without a cluster: refs of this process
and of another (a process that does not exist), fetched through `rdt.fetch` and `rdt.get`
over transports of these tests. What a transport moves is tested by the contract suite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import os
import secrets
import socket
import time
import types

import pytest
import torch

import rdt_async as rdt
from rdt_async import _avoid, _buffers, _choose, _fetch, _io, _object, _ray, _transfer, _tree
from rdt_async._object import Process, RDTObject
from rdt_async._store import StoredObject, store
from rdt_async.transports import _base as transports_base
from rdt_async.transports import _net, _registry
from rdt_async.transports._base import Cost, TensorSpec, Transport
from rdt_async.transports.tcp import TcpMeta

NODE = "c" * 56


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """The few facts a fetch asks of Ray, answered here: this node, nobody died."""

    async def alive(producer, **_):
        return False

    monkeypatch.setattr(_ray, "node_id", lambda: NODE)
    monkeypatch.setattr(_ray, "hand_node_ip", lambda: None)
    monkeypatch.setattr(_ray, "producer_died", alive)
    monkeypatch.setattr(_ray, "died_on_this_node", lambda producer: False)
    monkeypatch.setattr(_avoid, "avoided", _avoid.Avoided())
    monkeypatch.setattr(_choose, "avoided", _avoid.avoided)
    monkeypatch.setattr(_transfer, "avoided", _avoid.avoided)


def made(value, transport: str, *, here: bool = False, meta=None):
    """A ref to `value`: of this process (`here`: kept in its store), else of another."""
    skeleton, tensors = _tree.flatten(value, tied=True)
    token = _object._token_for(os.getpid()) if here else "1:elsewhere"
    obj = RDTObject(
        secrets.token_hex(12), Process(NODE, token), transport, tuple(TensorSpec.of(t) for t in tensors),
        skeleton, meta if meta is not None else {transport: None}, {}, "anchor" if here else None,
    )
    if here:
        store.add(obj.obj_id, StoredObject(list(tensors)))
    return obj


class _Fills(Transport):
    """Writes `FILL` into the caller's buffers (its own tensors without them), after `DELAY` s."""

    devices = ("cpu",)
    FILL, DELAY = 5.0, 0.0

    async def receive(self, info, buffers, channel):
        await asyncio.sleep(self.DELAY)
        out = buffers or [torch.empty(s.shape, dtype=s.dtype) for s in info.specs]
        for b in out:
            b.fill_(self.FILL)
        return out


class Slow(_Fills):
    DELAY = 0.05


class Unreachable(_Fills):
    auto_costs = {"cpu/node": Cost(1e-6, 100.0), "cpu/hosts": Cost(1e-6, 100.0)}  # auto's first choice

    async def receive(self, info, buffers, channel):
        raise rdt.TransportUnavailableError("no room here for this test's transport", obj_id=info.obj_id)


class Next(_Fills):
    auto_costs = {"cpu/node": Cost(1e-3, 1.0), "cpu/hosts": Cost(1e-3, 1.0)}
    FILL = 9.0


class OwnTensors(_Fills):
    """Hands back tensors of its own, its buffers untouched (against the contract)."""

    FILL = 3.0

    async def receive(self, info, buffers, channel):
        return [torch.full(s.shape, self.FILL, dtype=s.dtype) for s in info.specs]


class Later(_Fills):
    """Slower than tcp by its declared cost, faster than the object store: auto's next path after tcp."""

    auto_costs = {"cpu/node": Cost(0.005, 1.0), "cpu/hosts": Cost(0.005, 1.0)}  # (the object store: 5.5 ms)
    FILL = 7.0


class Grouped(Unreachable):
    """A collective group's transport of a user's, auto's first choice, that cannot serve."""

    needs_group = True

    @classmethod
    def group_meta(cls, group, rank):
        return (group, rank)


class DeviceReader(_Fills):
    """Reads into buffers on any of its devices (a GPU's stand-in: none here), and refuses
    metadata other than its `prepare`'s."""

    devices = ("cpu", "cuda")
    cross_device_buffers = True

    def check_meta(self, info):
        if info.meta != "prepared":
            raise rdt.TransferError(f"the ref's metadata {info.meta!r} is not what prepare makes", obj_id=info.obj_id)

    async def receive(self, info, buffers, channel):
        self.check_meta(info)
        return await super().receive(info, buffers, channel)


rdt.register_transport("core-device", ["cpu", "cuda"], DeviceReader)

for _cls, _name in [
    (Slow, "core-slow"), (Unreachable, "core-unreachable"), (Next, "core-next"), (OwnTensors, "core-own"), (Later, "core-later"),
    (Grouped, "core-group"),
]:
    rdt.register_transport(_name, ["cpu"], _cls)


def test_a_second_name_of_a_tied_tensor_is_not_received_into_memory_this_process_keeps():
    # The buffer of a tied tensor's second name gets a copy: it was checked against
    # neither the objects this process keeps nor (same process) the object's own tensors.
    kept = torch.arange(4.0)
    keeper = made([kept], "core-slow", here=True)
    w = torch.zeros(4)
    remote = made({"a": w, "b": w}, "core-slow")
    with pytest.raises(ValueError, match=r"into= tensor 1 shares memory with object [0-9a-f]{24}, which this process produced"):
        rdt.get(remote, into={"a": torch.zeros(4), "b": kept})
    w, v = torch.full((4,), 1.0), torch.full((4,), 2.0)
    local = made({"a": w, "b": w, "c": v}, "core-slow", here=True)
    with pytest.raises(ValueError, match="into= tensor 1 shares memory with tensor 1 of the object it receives"):
        rdt.get(local, into={"a": torch.zeros(4), "b": v, "c": torch.zeros(4)})
    assert v.tolist() == [2.0] * 4 and kept.tolist() == [0.0, 1.0, 2.0, 3.0]  # neither written
    got = rdt.get(local, into={"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)})
    assert [got[k].tolist() for k in "abc"] == [[1.0] * 4, [1.0] * 4, [2.0] * 4]
    for obj in (keeper, local):
        store.free(obj.obj_id)


async def test_a_same_process_fetch_holds_what_it_has_yet_to_copy_through_a_free():
    # A fetch into buffers another fetch still writes waits for them; meanwhile the producer
    # frees the object and waits for its tensor to be free before writing it in place:
    # wait_tensor_freed returned at once and the fetch copied the new value.
    x = torch.full((1 << 16,), 1.0)
    obj = made([x], "core-slow", here=True)
    buf = torch.zeros(1 << 16)
    other = _buffers.checked_writes(obj.specs, [buf])[1]
    assert other is not None and other.claim_nowait()  # another fetch into buf, under way
    fetching = asyncio.ensure_future(rdt.fetch(obj, into=[buf]))
    await asyncio.sleep(0.05)
    assert not fetching.done()
    rdt.free(obj)
    waiting = asyncio.ensure_future(rdt.wait_tensor_freed(x))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the fetch has yet to read x
    other.release()
    got = await asyncio.wait_for(fetching, 5)
    await asyncio.wait_for(waiting, 5)
    assert got[0] is buf and buf.eq(1.0).all()
    assert not store.held(x)


def test_a_get_that_times_out_before_its_fetch_begins_leaves_its_buffers_to_the_next():
    obj = made([torch.zeros(4)], "core-slow")
    buf = torch.zeros(4)
    _io.io_loop().call_soon_threadsafe(time.sleep, 0.2)  # busy: the fetch is given up before it begins
    try:
        rdt.get(obj, into=[buf], timeout=0)
    except TimeoutError as exc:
        kept = exc  # (a caller that keeps the error keeps its traceback's frames)
    began = time.monotonic()
    assert rdt.get(obj, into=[buf], timeout=10)[0] is buf
    assert time.monotonic() - began < 5 and buf.eq(Slow.FILL).all(), time.monotonic() - began
    del kept
    gc.collect()


def test_a_ref_naming_an_object_of_this_process_with_other_specs_is_refused():
    w = torch.full((3,), 7, dtype=torch.int64)
    obj = made({"w": w}, "core-slow", here=True)
    altered = RDTObject(
        obj.obj_id, obj.producer, obj.transport, (TensorSpec((1000,), torch.float32, "cpu", 4000),),
        obj.skeleton, obj.meta, {}, obj.anchor,
    )
    buf = torch.zeros(1000)
    with pytest.raises(rdt.TransferError, match=r"says its tensor 0 is float32\[1000\]@cpu; it is int64\[3\]@cpu: the ref was altered"):
        rdt.get(altered, into={"w": buf})
    with pytest.raises(rdt.TransferError, match="the ref was altered"):
        rdt.get(altered)
    assert buf.eq(0).all()
    assert rdt.get(obj)["w"] is w
    store.free(obj.obj_id)


def test_a_transport_that_hands_back_tensors_of_its_own_still_fills_into():
    obj = made([torch.zeros(4), torch.zeros(2, dtype=torch.int64)], "core-own")
    bufs = [torch.zeros(4), torch.zeros(2, dtype=torch.int64)]
    got = rdt.get(obj, into=bufs)
    assert got[0] is bufs[0] and got[1] is bufs[1]
    assert bufs[0].eq(3.0).all() and bufs[1].eq(3).all()
    got = asyncio.run(rdt.fetch(obj, into=bufs))
    assert got[0] is bufs[0] and bufs[1].eq(3).all()


def test_auto_asked_by_the_consumer_falls_back_as_auto_chosen_by_the_producer_does():
    meta = {"core-unreachable": None, "core-next": None}
    chosen_by_producer = made([torch.zeros(4)], "auto", meta=meta)
    assert rdt.get(chosen_by_producer, timeout=10)[0].eq(Next.FILL).all()
    _avoid.avoided.clear()
    named_by_producer = made([torch.zeros(4)], "core-unreachable", meta=meta)
    with pytest.raises(rdt.TransportUnavailableError, match="no room here"):
        rdt.get(named_by_producer, timeout=10)  # named: fails
    got = rdt.get(named_by_producer, timeout=10, tensor_transport="auto")
    assert got[0].eq(Next.FILL).all()
    assert rdt.store_stats()["auto"][-1]["fell_back"][0]["transport"] == "core-unreachable"


@pytest.mark.parametrize("node", [12345, None, ("a",), "node-a"])
def test_a_ref_whose_producer_node_id_is_no_ray_node_id_is_refused_before_auto_remembers_it(node):
    obj = made([torch.zeros(4)], "auto", meta={"core-unreachable": None, "core-next": None})
    crafted = dataclasses.replace(obj, producer=Process(node, "1:elsewhere"))
    with pytest.raises(rdt.TransferError, match=r"producer node id .* the ref was altered"):
        rdt.get(crafted, timeout=10)
    assert not _avoid.avoided.any()
    assert rdt.get(obj, timeout=10)[0].eq(Next.FILL).all()  # (a ref of a real node falls back, as ever)


def test_a_ref_naming_a_live_producers_tcp_listener_with_another_token_or_a_closed_port_leaves_its_objects_on_tcp():
    """A stale or crafted ref falls back, for that fetch: one whose listener greets for
    another token, or one naming a closed port of the host (the host answered: refused),
    leaves nothing out. The producer's own objects still go over tcp."""
    tcp = _registry.transport("tcp")
    t = torch.arange(8, dtype=torch.float32)
    good_id = secrets.token_hex(12)
    meta = tcp.prepare(good_id, [t])
    try:
        good = dataclasses.replace(made([t], "auto", meta={"tcp": meta, "core-later": None}), obj_id=good_id)
        with socket.socket(_net.Address(meta.host, "", "").family) as s:
            s.bind((meta.host, 0))
            closed = s.getsockname()[1]
        for bad in (dataclasses.replace(meta, token=b"x" * 16), dataclasses.replace(meta, port=closed)):
            assert rdt.get(made([torch.zeros(8)], "auto", meta={"tcp": bad, "core-later": None}), timeout=10)[0].eq(Later.FILL).all()
            assert rdt.store_stats()["auto"][-1]["fell_back"][0]["transport"] == "tcp"
            assert torch.equal(rdt.get(good, timeout=10)[0], t)
            assert rdt.store_stats()["auto"][-1]["transport"] == "tcp"
        assert _avoid.avoided.of(NODE) == frozenset()
    finally:
        tcp.garbage_collect(good_id, meta)


def test_auto_falls_back_from_a_group_both_ends_share_whose_transport_cannot_serve(monkeypatch):
    monkeypatch.setattr(_choose.groups, "memberships", lambda: {"g": ("core-group", 1)})
    obj = made([torch.zeros(4)], "auto", meta={"groups": {"g": ("core-group", 0)}, "core-next": None})
    assert rdt.get(obj, timeout=10)[0].eq(Next.FILL).all()
    choice = rdt.store_stats()["auto"][-1]
    assert choice["transport"] == "core-next", choice
    assert choice["fell_back"] == [{"transport": "core-group", "why": "no room here for this test's transport"}]
    # A group that could not reach that node lately is left out as a prepared path is.
    cut_off = rdt.TransferError("core-group fetch failed")
    cut_off.__cause__ = transports_base.Unreachable("no route")
    _avoid.avoided.note(obj.producer, "core-group", cut_off, "no route")
    assert _choose.choose_transport(obj, NODE)[0] == "core-next"
    assert rdt.store_stats()["auto"][-1]["why"].endswith("core-group left out: could not reach that node lately")


def test_where_the_path_auto_fell_back_to_fails_too_its_error_says_why_the_first_could_not_be_used():
    # A driver's put whose tcp listener is closed: the object store cannot serve it either,
    # and its error alone named neither the address tcp tried nor the setting to change.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    obj = made([torch.zeros(4)], "auto", meta={"tcp": TcpMeta("127.0.0.1", closed, b"t" * 16)})
    with pytest.raises(rdt.TransportUnavailableError) as err:
        rdt.get(obj, timeout=10)
    said = str(err.value)
    assert said.startswith("transport 'object_store' cannot serve this fetch: the object was put by driver/process 1"), said
    assert f" (auto took object_store after: tcp: cannot reach the producer's tcp listener at 127.0.0.1:{closed} (" in said, said
    assert "set RDT_TCP_HOST (this transport) or RDT_ADVERTISE_HOST" in said, said
    assert rdt.store_stats()["auto"][-1]["fell_back"][0]["transport"] == "tcp"


def test_into_a_mapping_that_names_the_objects_tensors_in_another_order_is_matched_by_name():
    # A state dict rebuilt with its keys in another order: paired in order, two tensors of
    # one shape were swapped silently.
    w, b, v = torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((2,), 3.0)
    obj = made({"layer": {"w": w, "b": b}, "tied": w, "v": v}, "core-slow", here=True)
    into = {"v": torch.zeros(2), "tied": torch.zeros(4), "layer": {"b": torch.zeros(4), "w": torch.zeros(4)}}
    got = rdt.get(obj, into=into)
    assert got["layer"]["w"] is into["layer"]["w"] and got["v"] is into["v"]
    assert into["layer"]["w"].eq(1.0).all() and into["layer"]["b"].eq(2.0).all()
    assert into["tied"].eq(1.0).all() and into["v"].eq(3.0).all()
    with pytest.raises(ValueError, match=r"into= tensor 3 \(into\['layer'\]\['w'\]\) .*float64"):
        rdt.get(obj, into={**into, "layer": {"b": torch.zeros(4), "w": torch.zeros(4, dtype=torch.float64)}})
    # Other names (a prefix of a wrapper): paired in order, as the docs say.
    plain = made({"w": w, "b": b}, "core-slow", here=True)
    other = {"module.w": torch.zeros(4), "module.b": torch.zeros(4)}
    rdt.get(plain, into=other)
    assert other["module.w"].eq(1.0).all() and other["module.b"].eq(2.0).all()
    for o in (obj, plain):
        store.free(o.obj_id)


def test_a_ref_whose_specs_name_a_device_its_transport_does_not_move_is_refused():
    # The object store moved a spec's `meta` device into a tensor without bytes, silently.
    meta_spec = TensorSpec((4,), torch.float32, "meta", 16)
    obj = made([torch.zeros(4)], "core-slow")
    altered = RDTObject(obj.obj_id, obj.producer, obj.transport, (meta_spec,), obj.skeleton, obj.meta, {}, None)
    with pytest.raises(rdt.TransferError, match=r"tensor 0 is said to be on meta, which transport 'core-slow' does not move \(cpu\)"):
        rdt.get(altered)
    store_ref = RDTObject(obj.obj_id, obj.producer, "object_store", (meta_spec,), obj.skeleton, {"object_store": None}, {}, None)
    with pytest.raises(rdt.TransferError, match="which transport 'object_store' does not move"):
        rdt.get(store_ref)


def test_a_fetch_to_a_device_allocates_nothing_there_for_a_ref_whose_metadata_its_transport_refuses(monkeypatch):
    # The buffers on the device were allocated (a crafted ref reserved GPU memory) before
    # the transport looked at the metadata.
    allocated, empty = [], torch.empty

    def on_device(*shape, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            allocated.append((tuple(*shape), str(device)))
            device = "meta"  # (no GPU here: a tensor without memory)
        return empty(*shape, device=device, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", on_device)
    crafted = made([torch.zeros(1 << 20)], "core-device", meta={"core-device": "crafted"})
    with pytest.raises(rdt.TransferError, match="the ref's metadata 'crafted' is not what prepare makes"):
        rdt.get(crafted, device="cuda")
    assert allocated == []
    prepared = made([torch.zeros(1 << 20)], "core-device", meta={"core-device": "prepared"})
    start = _fetch._start(prepared, None, "cuda")  # (what it transfers with: the buffers made)
    assert allocated == [((1 << 20,), "cuda")] and start.buffers[0].shape == (1 << 20,)
    _fetch.abandon(start)


async def test_a_same_process_subscriber_of_a_small_version_gets_that_version(monkeypatch):
    # A small version travels inline and holds nothing, so the publisher may write its slot
    # at the next publish; a fetch in the publishing process got the slot (a later version)
    # instead of the bytes in the ref.
    from rdt_async import _produce, _publish

    me = Process(NODE, _object._token_for(os.getpid()))
    monkeypatch.setattr(_produce, "here", lambda: me)
    monkeypatch.setattr(_ray, "several_nodes", lambda: False)
    monkeypatch.setattr(_publish, "_check_place", lambda: None)
    pub = rdt.Publisher("small", slots=2)
    try:
        await pub.publish({"w": torch.full((4,), 0.0)})
        first = pub._newest.obj  # what a poll hands a subscriber now
        pub._newest.handed = True  # (as the poll's answer marks it)
        assert list(first.meta) == ["inline"]
        for v in (1.0, 2.0):  # the second reuses the first's slot
            await pub.publish({"w": torch.full((4,), v)})
        assert (await _publish._fetch(first, None))["w"].tolist() == [0.0] * 4
        into = {"w": torch.full((4,), -1.0)}
        assert (await _publish._fetch(first, into))["w"].tolist() == [0.0] * 4
    finally:
        pub.close()


async def test_a_one_sided_ray_manager_that_hands_back_the_producers_memory_gives_the_consumer_its_own():
    # The producer writes its tensor once its refs are gone (wait_tensor_freed returned):
    # the consumer's fetched tensor changed under it.
    import dataclasses

    from helpers import manager_base
    from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata, TensorTransportMetadata

    from rdt_async.testing import roundtrip
    from rdt_async.transports import _registry

    memory: dict[str, list[torch.Tensor]] = {}

    @dataclasses.dataclass
    class Meta(TensorTransportMetadata):
        key: str = ""

    class Mapping(manager_base("MAP")):
        """As Ray's CUDA IPC manager does, hands back views of the producer's memory (this
        process's tensors stand in for IPC-mapped ones)."""

        def extract_tensor_transport_metadata(self, obj_id, tensors):
            memory[obj_id] = list(tensors)
            return Meta([(t.shape, t.dtype) for t in tensors], "cpu", obj_id)

        def get_communicator_metadata(self, src, dst, backend=None):
            return CommunicatorMetadata()

        def recv_multiple_tensors(self, obj_id, meta, comm, target_buffers=None):
            return [t.view(t.shape) for t in memory[meta.key]]  # views, not copies

        def garbage_collect(self, obj_id, meta, tensors):
            memory.pop(obj_id, None)

    rdt.register_transport("core-ray-mapping", ["cpu"], Mapping)
    w = torch.zeros(4)
    got = (await roundtrip(_registry.transport("core-ray-mapping"), [w]))[0]
    w.add_(7.0)
    assert got.tolist() == [0.0] * 4 and got.data_ptr() != w.data_ptr()


class Counted(_Fills):
    started = 0

    async def receive(self, info, buffers, channel):
        type(self).started += 1
        return await super().receive(info, buffers, channel)


rdt.register_transport("core-counted", ["cpu"], Counted)


async def test_fetch_all_over_an_iterable_that_raises_midway_starts_no_fetch():
    def refs():
        for _ in range(3):
            yield made([torch.zeros(4)], "core-counted")
        raise RuntimeError("the caller's iterable")

    before = Counted.started
    with pytest.raises(RuntimeError, match="the caller's iterable"):
        await rdt.fetch_all(refs())
    left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("fetch")]
    await asyncio.sleep(0.1)
    assert left == [] and Counted.started == before  # none left running behind the error


class Stubborn(Transport):
    """Writes the caller's buffers for 0.5 s, through any cancel (a copy under way)."""

    devices = ("cpu",)
    done = False

    async def receive(self, info, buffers, channel):
        def work():
            for k in range(50):
                buffers[0].fill_(k + 1)
                time.sleep(0.01)
            Stubborn.done = True  # (not type(self): the registry may subclass it)
            return buffers

        return await _io.to_thread_finished(work)


rdt.register_transport("core-stubborn", ["cpu"], Stubborn)


async def test_a_fetch_given_up_on_before_its_transfer_let_go_keeps_into_claimed_until_it_does(monkeypatch):
    # Past `_io.SETTLE_S` a cancelled fetch returns while its transfer still writes `into=`:
    # its claim went with it, and the next fetch into those buffers wrote beside the first.
    monkeypatch.setattr(_io.Started, "settle", functools.partialmethod(_io.Started.settle, 0.05))
    buf = torch.zeros(4)
    obj = made([buf], "core-stubborn")
    fetch = asyncio.ensure_future(rdt.fetch(obj, into=[buf]))
    while not buf[0]:  # (written from a thread once the transfer runs)
        await asyncio.sleep(0.005)
    fetch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fetch
    assert not Stubborn.done  # (given up on: still writing)
    after = _buffers.checked_writes(obj.specs, [buf])[1]
    assert not after.claim_nowait()
    await asyncio.wait_for(after.claim(), 5)
    assert Stubborn.done and buf.eq(50).all()  # claimed once the transfer let go, not before
    after.release()


def test_an_interrupt_as_a_claim_is_taken_leaves_nothing_claimed(monkeypatch):
    # A Ctrl-C between the claim's entry and its release's set-up left the entry for good:
    # the next fetch into those buffers waited forever.
    buf = torch.zeros(64)
    claimed = _buffers.checked_writes([TensorSpec.of(buf)], [buf])[1]
    real = _buffers._claims.take

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(_buffers._claims, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        claimed.claim_nowait()
    monkeypatch.undo()
    claimed.release()
    again = _buffers.checked_writes([TensorSpec.of(buf)], [buf])[1]
    assert again.claim_nowait()
    again.release()


_TWICE = r"""
import signal, threading, time, json, asyncio, torch
import rdt_async as rdt
from rdt_async import _ray, _io
from rdt_async._object import Process, RDTObject
from rdt_async.transports._base import TensorSpec, Transport
_ray.node_id = lambda: "c" * 56
_ray.hand_node_ip = lambda: None
async def alive(p, **_): return False
_ray.producer_died = alive
_ray.died_on_this_node = lambda p: False

class Writes300ms(Transport):
    devices = ("cpu",)
    async def receive(self, info, buffers, channel):
        def work():
            for k in range(300):
                buffers[0].fill_(k + 1)
                time.sleep(0.001)
            return buffers
        return await _io.to_thread_finished(work)

rdt.register_transport("twice", ["cpu"], Writes300ms)
obj = RDTObject("ab" * 12, Process("c" * 56, "1:elsewhere"), "twice", (TensorSpec.of(torch.zeros(4096)),), None, {"twice": None}, {}, None)
buf = torch.zeros(4096)
main = threading.main_thread().ident
def ctrl_c_twice():
    time.sleep(0.05); signal.pthread_kill(main, signal.SIGINT)
    time.sleep(0.02); signal.pthread_kill(main, signal.SIGINT)
threading.Thread(target=ctrl_c_twice).start()
began = time.monotonic()
try:
    rdt.get(obj, into=[buf])
except KeyboardInterrupt:
    pass
took = time.monotonic() - began
seen = buf[0].item()
time.sleep(0.2)
print(json.dumps({"took": took, "written_after": buf[0].item() != seen}))
"""


def test_a_second_ctrl_c_in_get_returns_only_once_nothing_writes_into():
    # The second interrupt came while the first's cancel waited for the transport to let go:
    # rdt.get returned at once while the transfer still wrote `into=` (its claim let go too).
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TWICE], capture_output=True, text=True, timeout=120)
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert not said["written_after"] and said["took"] > 0.25, (said, done.stderr[-2000:])


def test_an_object_store_replys_size_is_asked_of_its_owner_once(monkeypatch):
    # Every consumer of a node may fetch one reply: each asked its owner again, a round
    # trip and a thread of the calls pool each (5 s each where the owner was out of reach).
    asked = []

    def located(ref):
        asked.append(ref)
        return {"object_size": 900 if ref.binary() == b"ok" else 1 << 30}

    monkeypatch.setattr(_ray, "_located", located)
    monkeypatch.setattr(_ray, "_sized", type(_ray._sized)())
    obj = types.SimpleNamespace(nbytes=832, specs=[None, None], obj_id="o" * 32)
    reply, huge = types.SimpleNamespace(binary=lambda: b"ok"), types.SimpleNamespace(binary=lambda: b"huge")
    for _ in range(3):
        _io.start(_ray._check_reply(obj, reply, "object_store")).result()
        with pytest.raises(rdt.TransferError, match="the ref's object-store reply is 1073741824 bytes, not the one"):
            _io.start(_ray._check_reply(obj, huge, "object_store")).result()
    assert len(asked) == 2 and _ray.REPLY_ASK_S <= 1.0
