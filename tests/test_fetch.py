"""User stories: producers keep tensors, consumers get them with values intact."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import ray
import torch
from helpers import checksum

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Weights:
    w: torch.Tensor
    name: str


@rdt.remote
class AsyncProducer:
    @rdt.method
    async def make(self, n: int):
        return [torch.arange(n, dtype=torch.int64), {"nt": Pair(torch.ones(3), "b")}, Weights(torch.zeros(2, 2), "w")]

    async def write_then_sum(self, t):  # (a consumer too: it writes what it fetched)
        t += 1
        return checksum(t)


@rdt.remote(max_concurrency=4)
class ThreadedProducer:
    @rdt.method
    def make(self, n: int):
        return (torch.full((n,), 2.0), "tag")

    def write_then_sum(self, t):
        t += 1
        return checksum(t)

    @rdt.method(tensor_transport="object_store")  # sent from these tensors when another process fetches
    def make_kept(self):
        self.t = torch.arange(4.0)
        return self.t

    def fetch_back(self, refs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same = rdt.get(refs[0]) is self.t
        return same, [(str(w.message), w.filename) for w in caught]


@pytest.fixture
def producer(sync_producer):
    return sync_producer


@pytest.fixture
def consumer(async_consumer):
    return async_consumer


# The module's own actors (each a process that imports torch), made once: a producer of
# each kind, which are also the consumers whose writes must stay their own.
@pytest.fixture(scope="module")
def async_producer():
    a = AsyncProducer.remote()
    yield a
    ray.kill(a)


@pytest.fixture(scope="module")
def threaded_producer():
    t = ThreadedProducer.remote()
    yield t
    ray.kill(t)


def test_ref_resolves_to_rdt_object_whose_repr_says_how_to_fetch(producer):
    obj = ray.get(producer.make.remote(8))
    assert isinstance(obj, rdt.RDTObject)
    assert obj.specs[0].shape == (8,) and obj.specs[0].dtype == torch.float32
    assert "rdt.fetch" in repr(obj) and "float32[8]@cpu" in repr(obj)



def test_nested_structure_survives_the_trip(producer, consumer):
    value = ray.get(consumer.take.remote(producer.make.remote(16, seed=3)))
    expected = torch.randn(16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(value["w"], expected)
    assert value["step"] == 3 and value["meta"] == ["x", (1, 2)]


def test_several_args_fetched_concurrently(producer, consumer):
    a = producer.value.remote(torch.arange(100.0))
    b = producer.value.remote(torch.ones(50, dtype=torch.float64))
    c = producer.value_os.remote(torch.full((10,), 3.0))
    sums = ray.get(consumer.checksums.remote(a, b, c=c))
    assert sums == [4950.0, 50.0, 30.0]


def test_async_and_threaded_producers(consumer, async_producer, threaded_producer):
    ap, tp = async_producer, threaded_producer
    v = ray.get(consumer.take.remote(ap.make.remote(5)))
    assert v[0].tolist() == [0, 1, 2, 3, 4]
    assert isinstance(v[1]["nt"], Pair) and v[1]["nt"].b == "b" and v[1]["nt"].a.tolist() == [1.0, 1.0, 1.0]
    assert isinstance(v[2], Weights) and v[2].name == "w" and v[2].w.shape == (2, 2)
    t = ray.get(consumer.take.remote(tp.make.remote(4)))
    assert t[0].tolist() == [2.0] * 4 and t[1] == "tag"


def test_nested_refs_fetch_fetch_all_as_completed(producer, consumer):
    refs = [producer.value.remote(torch.full((4,), float(i))) for i in range(5)]
    one = ray.get(consumer.fetch.remote([refs[2]]))
    assert one.tolist() == [2.0] * 4
    all_ = ray.get(consumer.fetch_all.remote(refs))
    assert [t[0].item() for t in all_] == [0.0, 1.0, 2.0, 3.0, 4.0]
    order = ray.get(consumer.as_completed.remote(refs))
    assert sorted(order) == [0, 1, 2, 3, 4]


def test_driver_get_and_plain_refs(producer):
    v = rdt.get(producer.make.remote(32, seed=1), timeout=60)
    assert torch.equal(v["w"], torch.randn(32, generator=torch.Generator().manual_seed(1)))
    assert rdt.get(ray.put({"plain": 1})) == {"plain": 1}


def test_get_on_a_running_loop_says_to_await_fetch(producer, consumer):
    ref = producer.value.remote(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"await rdt\.fetch"):
        ray.get(consumer.get_in_loop.remote([ref]))


def test_dtypes_views_and_odd_shapes(producer, consumer):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {
        "t": base.t(),                       # non-contiguous
        "col": base[:, 2],                   # strided view
        "bf16": torch.linspace(0, 1, 7).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    for method in (producer.value, producer.value_os):
        out = ray.get(consumer.take.remote(method.remote(value)))
        for k, t in value.items():
            assert out[k].dtype == t.dtype and out[k].shape == t.shape, k
            assert torch.equal(out[k], t), k


def test_value_without_tensors_still_works(producer, consumer):
    ref = producer.value.remote({"just": [1, "two"]})
    obj = ray.get(ref)
    assert isinstance(obj, rdt.RDTObject) and obj.specs == ()
    assert ray.get(consumer.take.remote(ref)) == {"just": [1, "two"]}
    assert rdt.get(ref) == {"just": [1, "two"]}


def test_into_receives_into_caller_buffers(producer, consumer):
    src = {"a": torch.arange(10.0), "b": [torch.ones(3, 3, dtype=torch.int32)]}
    ref = producer.value.remote(src)
    into = {"a": torch.empty(10), "b": [torch.zeros(3, 3, dtype=torch.int32)]}
    ptrs = (into["a"].data_ptr(), into["b"][0].data_ptr())
    out = rdt.get(ref, into=into)
    assert (out["a"].data_ptr(), out["b"][0].data_ptr()) == ptrs
    assert torch.equal(into["a"], src["a"]) and torch.equal(into["b"][0], src["b"][0])
    flat = [torch.empty(10), torch.empty(3, 3, dtype=torch.int32)]
    out = rdt.get(producer.value_os.remote(src), into=flat)
    assert out["a"] is flat[0] and torch.equal(flat[1], src["b"][0])


def test_into_mismatch_names_the_tensor(producer):
    ref = producer.value.remote(torch.ones(4))
    with pytest.raises(ValueError, match=r"into= tensor 0 is float64\[4\]@cpu; the object's tensor 0 is float32\[4\]@cpu"):
        rdt.get(ref, into=torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="into= holds 2 tensor"):
        rdt.get(ref, into=[torch.empty(4), torch.empty(4)])


def test_device_moves_tensors(producer):
    out = rdt.get(producer.value.remote(torch.ones(3)), device="cpu")
    assert out.device == torch.device("cpu") and out.tolist() == [1.0, 1.0, 1.0]


def test_consumers_never_see_each_others_writes(producer, async_producer, threaded_producer):
    ref = producer.value.remote(torch.zeros(1 << 16))
    w1, w2 = async_producer, threaded_producer  # two consumers, each writing what it fetched
    assert ray.get(w1.write_then_sum.remote(ref)) == float(1 << 16)
    assert ray.get(w2.write_then_sum.remote(ref)) == float(1 << 16)
    assert checksum(rdt.get(ref)) == 0.0


def test_same_process_fetch_returns_the_stored_tensors():
    t = torch.arange(6.0)
    ref = rdt.put({"t": t})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fetched here only: nothing to warn about
        out = rdt.get(ref)
    assert out["t"] is t
    into = torch.empty(6)
    assert rdt.get(ref, into=into)["t"] is into and torch.equal(into, t)
    del ref


def test_fetch_records_the_transport_used(producer, consumer):
    big = torch.ones(1 << 15)  # 128 KiB: above what auto inlines
    refs = [producer.value.remote(torch.ones(2)), producer.value.remote(big), producer.value_os.remote(big)]
    before = collections.Counter(ray.get(consumer.stats.remote())["fetches"])
    ray.get(consumer.fetch_all.remote(refs))
    got = collections.Counter(ray.get(consumer.stats.remote())["fetches"]) - before
    assert got == {"inline": 1, "shm": 1, "object_store": 1}


def test_into_large_objects_contiguous_and_strided_buffers(producer):
    src = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.arange(1 << 18, dtype=torch.int64).reshape(512, 512)}
    ref = producer.value.remote(src)  # 6 MiB: read on the I/O loop, not inline
    strided = torch.empty(512, 512, dtype=torch.int64).t()  # not contiguous: copied through a mapping
    into = {"a": torch.empty(1 << 20), "b": strided}
    out = rdt.get(ref, into=into, timeout=60)
    assert out["a"].data_ptr() == into["a"].data_ptr() and out["b"] is strided
    assert torch.equal(into["a"], src["a"]) and torch.equal(strided, src["b"])


def test_the_producer_fetching_back_what_another_process_fetched_warns_once_at_the_caller(consumer, threaded_producer):
    # (In the other order, the send finds the local fetch and logs the same warning.)
    p, c = threaded_producer, consumer
    alone = p.make_kept.remote()
    same, caught = ray.get(p.fetch_back.remote([alone]))
    assert same and caught == []  # only fetched back: no other reader, no warning (as in Ray)
    ref = p.make_kept.remote()
    assert ray.get(c.checksums.remote(ref)) == [6.0]  # another process fetches it
    same, caught = ray.get(p.fetch_back.remote([ref]))
    assert same and len(caught) == 1, caught
    message, filename = caught[0]
    assert "fetched both by the process that produced it" in message and "Clone before writing" in message
    assert filename == __file__  # points at the caller's line, not at rdt_async
    assert ray.get(p.fetch_back.remote([ref]))[1] == []  # once per object
