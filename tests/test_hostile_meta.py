"""A ref's metadata is input: crafted nixl, object_store, inline and Ray-manager fields.

Each case alters one field of a real RDTObject and fetches it: the consumer raises a
TransferError naming the field, reads nothing into the caller's memory, leaks no
registration or connection, and still fetches the real object afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import time

import pytest

pytest.importorskip("nixl")

import ray
import torch
from conftest import wait_until
from helpers import checksum, manager_base
from ray.experimental.rdt import CommunicatorMetadata, TensorTransportMetadata

import rdt_async as rdt
from rdt_async import TransferError
from rdt_async.transports import _registry
from rdt_async.transports._base import TransferInfo

pytestmark = pytest.mark.usefixtures("ray_session")


@dataclasses.dataclass
class InMetaMeta(TensorTransportMetadata):
    blob: bytes = b""


class SpoolInMeta(manager_base("IN_META")):
    """A one-sided Ray manager whose metadata carries the tensors themselves."""

    def extract_tensor_transport_metadata(self, obj_id, rdt_object):
        return InMetaMeta([(t.shape, t.dtype) for t in rdt_object], "cpu", pickle.dumps([t.clone() for t in rdt_object]))

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return CommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id, meta, comm, target_buffers=None):
        return pickle.loads(meta.blob)

    def send_multiple_tensors(self, tensors, meta, comm):
        raise NotImplementedError("one-sided")

    def garbage_collect(self, obj_id, meta, tensors):
        pass

    def abort_transport(self, obj_id, comm):
        pass


rdt.register_transport("spool-in-meta", ["cpu"], SpoolInMeta)


@rdt.remote
class Maker:
    def __init__(self) -> None:
        self.kept = torch.arange(4096, dtype=torch.float32)

    @rdt.method(tensor_transport="nixl")
    def three(self):
        return [self.kept[:1000], torch.linspace(0, 1, 300, dtype=torch.float64), torch.empty(0)]

    @rdt.method(tensor_transport="nixl")
    def other(self):
        return [torch.full((1000,), 7.0), torch.zeros(300, dtype=torch.float64), torch.empty(0)]

    @rdt.method(tensor_transport="nixl")
    def many_small(self, n: int):
        return [torch.tensor([i], dtype=torch.int32) for i in range(n)]

    @rdt.method(tensor_transport="nixl")
    def big_and_small(self):
        return [torch.full((1 << 18,), 1.5), *[torch.tensor([i], dtype=torch.int32) for i in range(10)]]

    @rdt.method(tensor_transport="inline")
    def inline(self):
        return [torch.arange(10, dtype=torch.int64), torch.ones(3)]

    @rdt.method(tensor_transport="spool-in-meta")
    def managed(self):
        return [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.ones(4)]


def fetched_by(consumer, obj) -> tuple[str, object]:
    """What another process (an AsyncConsumer) got fetching `obj`: "ok" and the checksums,
    or the error's type and message."""
    try:
        return "ok", [checksum(t) for t in ray.get(consumer.fetch.remote([obj]), timeout=30)]
    except ray.exceptions.RayTaskError as exc:
        return type(exc.cause).__name__, str(exc.cause)


@ray.remote
def _sleeps(s: float) -> None:
    time.sleep(s)


@pytest.fixture(scope="module")
def maker():
    m = Maker.remote()
    yield m
    ray.kill(m)


def _nixl():
    return _registry.transport("nixl")


def _remotes() -> int:
    here = _nixl()._current()
    return 0 if here is None else len(here.peers._remotes)


def crafted(obj, **fields):
    """The object with its nixl metadata's `fields` replaced."""
    meta = dataclasses.replace(obj.meta["nixl"], **fields)
    return dataclasses.replace(obj, meta={**obj.meta, "nixl": meta})


def _with_len(blob: bytes, tag: bytes, n: int) -> bytes:
    at = blob.index(tag) + len(tag)
    return blob[:at] + struct.pack("<Q", n) + blob[at + 8 :]


def _cases(obj, other):
    m = obj.meta["nixl"]
    d0, d1 = m.descs[0], m.descs[1]
    pid = os.getpid()
    return [
        ("descs", {"descs": m.descs[:2]}, "2 tensor descriptors for 3 tensors"),
        ("descs", {"descs": (d0, None, None)}, "tensor 1 (float64[300]@cpu) has no descriptor"),
        ("descs", {"descs": ((d0[0], d0[1] * 4, 0, "DRAM"), d1, None)}, "descriptor 0 is 16000 bytes, but tensor 0"),
        ("descs", {"descs": ((d0[0] + (1 << 30), d0[1], 0, "DRAM"), d1, None)}, "descriptor 0 (0x"),
        ("descs", {"descs": ((d0[0] - 64, d0[1], 0, "DRAM"), d1, None)}, "outside every region the producer registered"),
        ("descs", {"descs": ((d0[0], d0[1], 0, "VRAM"), d1, None)}, "descriptor 0 is VRAM of device 0, but tensor 0 is on cpu"),
        ("descs", {"descs": ((str(d0[0]), d0[1], 0, "DRAM"), d1, None)}, "descriptor 0 is not (address, nbytes, device, memory)"),
        ("descs", {"descs": [d0, d1, None]}, "descs is a list, not tuple"),
        ("agent", {"agent": f"rdt-elsewhere-{m.pid}-00000000"}, "is not the agent of pid"),
        ("agent", {"agent": m.agent[:-8] + "00000000"}, "names agent"),
        ("agent", {"agent": other.meta["nixl"].agent}, "is not the agent of pid"),
        ("pid", {"pid": pid, "agent": f"rdt-{m.host}-{pid}-{m.agent[-8:]}"}, f"its agent is in pid {pid}, but the ref's producer is pid {m.pid}"),
        ("conn", {"conn": b"hello"}, "the connection metadata is not NIXL metadata: not NIXL metadata (no nixlSerDes header)"),
        ("conn", {"conn": m.conn[: len(m.conn) // 2]}, "the connection metadata is not NIXL metadata"),
        ("conn", {"conn": _with_len(m.conn, b"Agent", (1 << 64) - 2)}, "past the blob's end"),
        ("conn", {"conn": m.conn.decode("latin-1")}, "conn is a str, not bytes"),
        ("regs", {"regs": (m.regs[0][:-3],)}, "region metadata 0 is not NIXL metadata"),
        ("regs", {"regs": other.meta["nixl"].regs}, "region metadata 0 names agent"),
        ("regs", {"regs": (m.regs[0] + b"x",)}, "trailing bytes"),
        ("regs", {"regs": ()}, "outside every region the producer registered"),
        ("slot", {"slot": m.slot + (1 << 40)}, "liveness slot 0x"),
        ("token", {"token": 0}, "liveness token out of range"),
        ("token", {"token": "1"}, "token is a str, not int"),
    ]


def test_crafted_nixl_metadata_is_refused_before_nixl_sees_it(maker):
    obj = ray.get(maker.three.remote())
    other_maker = Maker.remote()
    other = ray.get(other_maker.other.remote())
    want = [checksum(t) for t in rdt.get(obj)]  # connects once: the cases below add nothing
    rdt.get(other)
    t = _nixl()
    regs, remotes = t.registrations, _remotes()
    for field, change, message in _cases(obj, other):
        bad = crafted(obj, **change)
        into = [torch.full((1000,), -1.0), torch.full((300,), -1.0, dtype=torch.float64), torch.empty(0)]
        for kwargs in ({}, {"into": into}):
            with pytest.raises(TransferError) as info:
                rdt.get(bad, **kwargs)
            text = str(info.value)
            assert message in text, (field, text)
            assert "the ref's nixl metadata is not what its producer made" in text
            assert "nothing was read" in text
        assert torch.equal(into[0], torch.full((1000,), -1.0)) and torch.equal(into[1], torch.full((300,), -1.0, dtype=torch.float64))
        assert _remotes() == remotes, field  # no connection made to what a crafted field names
        assert [checksum(x) for x in rdt.get(obj)] == want, field  # the agent still reads
    wait_until(lambda: t.registrations == regs, 10, lambda: f"registrations {t.registrations} != {regs}")
    ray.kill(other_maker)


@pytest.mark.parametrize("bytes_apart", [4000, 8000], ids=["next-1000-floats", "past-them"])
def test_a_ref_altered_to_read_other_registered_memory_is_refused_and_hands_over_no_byte_of_it(maker, bytes_apart):
    """Nothing on the producer's side bounds a READ, and the region blobs are the ref's own:
    a descriptor moved within what the producer registered (`three` returns a view of
    1000 of `kept`'s 4096 floats: the whole storage is registered) passes every check of
    the metadata. The liveness slot holds a digest of the descriptors the producer
    exported: the fetch fails, and what the READ wrote is not handed over."""
    obj = ray.get(maker.three.remote())
    want = [checksum(t) for t in rdt.get(obj)]
    d0 = obj.meta["nixl"].descs[0]
    bad = crafted(obj, descs=((d0[0] + bytes_apart, *d0[1:]), *obj.meta["nixl"].descs[1:]))
    into = [torch.full((1000,), -1.0), torch.full((300,), -1.0, dtype=torch.float64), torch.empty(0)]
    for kwargs in ({}, {"into": into}):
        with pytest.raises(TransferError, match=f"nixl fetch of {obj.obj_id}: its ref's tensor descriptors are not the ones "
                           "its producer exported for it \\(the ref was altered\\); what was read was discarded"):
            rdt.get(bad, **kwargs)
    assert set(into[0].unique().tolist()) <= {-1.0, 0.0}, into[0][:4]  # (untouched, or zeroed: never kept[1000:])
    assert set(into[1].unique().tolist()) <= {-1.0, 0.0}
    assert [checksum(t) for t in rdt.get(obj)] == want  # the honest ref still reads


def test_a_crafted_meta_of_the_wrong_type_is_refused(maker):
    obj = ray.get(maker.three.remote())
    bad = dataclasses.replace(obj, meta={**obj.meta, "nixl": {"agent": "x"}})
    with pytest.raises(TransferError, match="metadata of type dict, not NixlMeta"):
        rdt.get(bad)
    with pytest.raises(TransferError, match="metadata of type dict, not NixlMeta"):  # (asked before buffers on device=)
        _nixl().check_meta(TransferInfo(bad.obj_id, bad.specs, bad.meta["nixl"]))
    assert [checksum(t) for t in rdt.get(obj)] == [checksum(t) for t in rdt.get(obj)]


def test_a_fetched_small_tensor_owns_its_bytes(maker):
    """1000 tensors of 4 bytes: each fetched one pickles as 4 bytes, not the landing block."""
    values = rdt.get(maker.many_small.remote(1000))
    assert [int(v) for v in values] == list(range(1000))
    one = values[5]
    assert one.untyped_storage().nbytes() == 4
    assert len(pickle.dumps(one)) < 1000
    assert len(pickle.dumps(values)) < 1000 * 1000  # was 61 MB: each carried the whole block
    # Beside a large tensor (not through the bounce chunk), the small ones are apart too.
    big, *small = rdt.get(maker.big_and_small.remote())
    assert torch.equal(big, torch.full((1 << 18,), 1.5))
    assert [int(v) for v in small] == list(range(10))
    assert all(s.untyped_storage().nbytes() == 4 for s in small)


def test_crafted_inline_bytes_are_refused(maker):
    obj = ray.get(maker.inline.remote())
    data = obj.meta["inline"]
    cases = [
        ((data[0][:-1], data[1]), "tensor 0 (int64[10]@cpu) is 80 bytes, but the ref carries 79 bytes"),
        ((data[0],), "it carries 1 tensor(s)' bytes for 2 tensor(s)"),
        ((data[0] * 2, data[1]), "tensor 0 (int64[10]@cpu) is 80 bytes, but the ref carries 160 bytes"),
        ((data[0].decode("latin-1"), data[1]), "but the ref carries a str"),
        ([*data], "it carries 2 tensor(s)' bytes for 2 tensor(s)"),
    ]
    for meta, message in cases:
        bad = dataclasses.replace(obj, meta={**obj.meta, "inline": meta})
        with pytest.raises(TransferError) as info:
            rdt.get(bad)
        assert message in str(info.value) and "inline fetch of" in str(info.value)
    got = rdt.get(obj)
    assert torch.equal(got[0], torch.arange(10)) and torch.equal(got[1], torch.ones(3))


def test_crafted_object_store_replies_are_refused(async_consumer):
    value = [torch.arange(100, dtype=torch.int64), torch.ones(8)]
    obj = rdt.put(value, tensor_transport="object_store")
    real = ray.get(obj)  # the driver serves no transfers: its reply was put with the object
    try:
        wrong = ray.put([torch.zeros(3).numpy().view("uint8"), torch.ones(8).numpy().view("uint8")])
        cases = [
            ({"object_store": "not a ref"}, "TransferError", "the ref's object-store reply is a str, not an ObjectRef"),
            ({"object_store": ray.put("hello")}, "TransferError", "(str array(s) for 2 tensor(s))"),
            ({"object_store": wrong}, "TransferError", "tensor 0 (int64[100]@cpu) is 800 bytes, but 12 came"),
        ]
        for eager, kind, message in cases:
            bad = dataclasses.replace(real, eager=eager)
            got = fetched_by(async_consumer, bad)
            assert got[0] == kind and message in got[1], got
        # Refused before anything is pulled: a task's result, which may never be made (the
        # fetch waited for it), and an object larger than the ref's 832 bytes (pulled whole).
        never, huge = _sleeps.remote(600), ray.put(torch.zeros(1 << 20, dtype=torch.uint8).numpy())
        try:
            for eager, message in ((huge, "is 1048"), (never, "is an object not made yet (a task's result)")):
                began = time.monotonic()
                got = fetched_by(async_consumer, dataclasses.replace(real, eager={"object_store": eager}))
                assert got[0] == "TransferError" and message in got[1], got
                assert "not the one put with its tensors (832 bytes); nothing was pulled" in got[1], got
                assert time.monotonic() - began < 10
        finally:
            ray.cancel(never, force=True)
        specs = (real.specs[0], dataclasses.replace(real.specs[1], shape=(16,), nbytes=64))
        got = fetched_by(async_consumer, dataclasses.replace(real, specs=specs))
        assert got == ("TransferError", got[1]) and "tensor 1 (float32[16]@cpu) is 64 bytes, but 32 came" in got[1]
        assert fetched_by(async_consumer, real) == ("ok", [checksum(v) for v in value])
    finally:
        rdt.free(obj)




def test_crafted_ray_manager_metadata_is_refused(maker):
    obj = ray.get(maker.managed.remote())
    meta = obj.meta["spool-in-meta"]
    tm = meta.transport_meta
    swapped = pickle.dumps([torch.ones(4), torch.arange(6).reshape(2, 3)])
    cases = [
        ("not meta", "its metadata is a str, not RayMeta"),
        (dataclasses.replace(meta, transport_meta=dataclasses.replace(tm, tensor_meta=tm.tensor_meta[:1])),
         "its manager's tensor_meta lists [int64[2, 3]], the ref's tensors are [int64[2, 3]@cpu, float32[4]@cpu]"),
        (dataclasses.replace(meta, transport_meta=dataclasses.replace(tm, blob=swapped)),
         "the manager returned float32[4] for tensor 0 (int64[2, 3]@cpu)"),
        (dataclasses.replace(meta, transport_meta=dataclasses.replace(tm, blob=pickle.dumps(["x"]))),
         "the manager returned str for tensor 0"),
        (dataclasses.replace(meta, transport_meta=dataclasses.replace(tm, blob=pickle.dumps([torch.zeros(2, 3, dtype=torch.int64)]))),
         "the manager returned 1 tensor(s) for 2"),
    ]
    for crafted_meta, message in cases:
        bad = dataclasses.replace(obj, meta={**obj.meta, "spool-in-meta": crafted_meta})
        with pytest.raises(TransferError) as info:
            rdt.get(bad)
        assert message in str(info.value), str(info.value)
    got = rdt.get(obj)
    assert torch.equal(got[0], torch.arange(6).reshape(2, 3)) and torch.equal(got[1], torch.ones(4))


def test_checks_cost_microseconds(maker):
    """The nixl check of a 1000-tensor object costs ~1 ms of CPU per fetch, not more (a bound
    for a check that grows quadratically, not a speed test: that is the bench's)."""
    from rdt_async.transports._base import TransferInfo
    from rdt_async.transports.nixl._check import check

    obj = ray.get(maker.many_small.remote(1000))
    info = TransferInfo(obj.obj_id, obj.specs, obj.meta["nixl"], hold=obj)
    check(info, None)
    began = time.thread_time()  # (this thread's CPU: a loaded machine's preemption is not the check's)
    for _ in range(20):
        check(info, None)
    per_fetch = (time.thread_time() - began) / 20
    assert per_fetch < 0.02, per_fetch  # ~1 us per tensor here: a check quadratic in the tensors fails
