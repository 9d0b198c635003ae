"""Values that are easy to get wrong: lazy conjugates, unaligned bytes, odd storages,
container subclasses, `into=` buffers a user really passes (parameters), and the
mistakes a user can make with them, each refused where it is made.
"""

from __future__ import annotations

import collections
import re

import pytest
import ray
import torch
from conftest import wait_until
from helpers import Tied

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

BIG = 1 << 19  # complex64 elements: 4 MiB, over shm's sharing threshold


class Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor and FakeTensor are): no memory of its own, data_ptr() 0."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, Wrapper) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Config(dict):
    """A dict subclass with an attribute of its own."""


class Batch(list):
    def __init__(self, items, tag):  # a list subclass whose __init__ takes more than items
        super().__init__(items)
        self.tag = tag


def expected() -> dict:
    c = torch.tensor([1 + 2j, -3 - 4j, 5j], dtype=torch.complex64)
    return {"conj": c.conj().resolve_conj(), "neg": c.conj().imag.resolve_neg()}


@rdt.remote
class Producer:
    def __init__(self) -> None:
        self.big = torch.arange(BIG, dtype=torch.float32).to(torch.complex64) * (1 + 1j)
        self.big.share_memory_()  # exported without a copy: a conj view of it must not be
        self.arena = torch.zeros((4 << 20) + 3, dtype=torch.uint8).share_memory_()
        self.arena[:16].view(torch.float32).copy_(torch.arange(4.0))

    def _lazy(self):
        c = torch.tensor([1 + 2j, -3 - 4j, 5j], dtype=torch.complex64)
        return {"conj": c.conj(), "neg": c.conj().imag, "big": self.big.conj()}

    @rdt.method
    def lazy_auto(self):
        return self._lazy()

    @rdt.method(tensor_transport="object_store")
    def lazy_object_store(self):
        return self._lazy()

    @rdt.method(tensor_transport="tcp")
    def lazy_tcp(self):
        return self._lazy()

    @rdt.method(tensor_transport="object_store")
    def odd_dtypes(self):
        return [torch.ones(3, dtype=torch.bool), torch.tensor([1 + 2j, 3 - 4j, 5j, 6, 7], dtype=torch.complex128)]

    @rdt.method
    def odd_storage(self):
        return self.arena[:16].view(torch.float32)  # a float32 view of a storage of 4 MiB + 3 bytes

    @rdt.method
    def containers(self):
        cfg = Config(w=torch.ones(2))
        cfg.version = 3
        return {"cfg": cfg, "batch": Batch([torch.zeros(2), "x"], tag="t"), "dd": collections.defaultdict(int, a=torch.ones(1))}

    @rdt.method
    def weights(self, n: int):
        return [torch.full((n,), 2.0), torch.full((n,), 3.0)]

    def held(self) -> int:
        return rdt.store_stats()["objects"]

    @rdt.method
    def tied(self, tie: bool, n: int):
        return Tied(tie, n).state_dict()

    @rdt.method
    def unmovable(self, kind: str, n: int, transport: str):
        t = {
            "quantized": lambda: torch.quantize_per_tensor(torch.arange(n, dtype=torch.float32), 0.1, 0, torch.qint8),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(n), torch.ones(n + 1)]),
            "meta": lambda: torch.empty(n, device="meta"),
            "wrapper": lambda: Wrapper(torch.ones(n)),
        }[kind]()
        return {"ok": torch.ones(4), "bad": t}

    # A storage the user made, not shared: read by one call while another returns it.
    def _w(self) -> torch.Tensor:
        if not hasattr(self, "w"):
            self.w = torch.ones(16 << 20)
        return self.w

    @rdt.method
    def publish(self):
        return self._w()

    def read(self, k: int) -> float:
        return float(sum(float(self._w().sum()) for _ in range(k)))

    def where(self) -> int:
        return self._w().untyped_storage().data_ptr()


@rdt.remote
class Consumer:
    async def values(self, refs) -> dict:
        out = {}
        for i, ref in enumerate(refs):
            v = await rdt.fetch(ref)
            out[i] = {k: t.resolve_conj().resolve_neg() for k, t in v.items()} if isinstance(v, dict) else v
        return out

    async def into_tied(self, refs, tie_here: bool, tie_there: bool, n: int):
        """Fetch a model's state dict into this side's model: whether every tensor holds the
        producer's values, and whether the value's two names are one tensor; or the error."""
        m = Tied(tie_here, n)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        try:
            got = await rdt.fetch(refs[0], into=m.state_dict())
        except ValueError as e:
            return str(e)
        want = Tied(tie_there, n).state_dict()
        return all(torch.equal(t, want[k]) for k, t in m.state_dict().items()), got["emb.weight"] is got["head.weight"]

    async def tied_value(self, refs):
        got = await rdt.fetch(refs[0])
        want = Tied(True, got["emb.weight"].shape[0]).state_dict()
        return list(got) == list(want), all(torch.equal(t, want[k]) for k, t in got.items()), got["emb.weight"] is got["head.weight"]

    async def into_params(self, refs, n: int) -> list:
        params = [torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))]
        await rdt.fetch(refs[0], into=params)  # model.parameters(), as a weight sync passes them
        return [float(p.detach().sum()) for p in params] + [all(p.requires_grad for p in params)]

    async def into_refused(self, refs, n: int) -> list[str]:
        said = []
        shared, wide = torch.zeros(n), torch.zeros(2 * n)
        for into in ([torch.zeros(1).expand(n), torch.zeros(n)], [shared, shared], [wide[n // 2 : n // 2 + n], wide[:n]]):
            try:
                await rdt.fetch(refs[0], into=into)
                said.append("accepted")
            except ValueError as e:
                said.append(str(e))
        return said

    async def free_on_loop(self, refs) -> str:
        try:
            rdt.free(refs[0])
        except RuntimeError as e:
            return str(e)
        return "returned"

    async def fail_all_without_gc(self, refs) -> str:
        import gc

        gc.disable()  # only references may free the objects, as between two collections
        try:
            await rdt.fetch_all(refs)
        except rdt.ObjectFreedError as e:
            return type(e).__name__
        finally:
            gc.enable()
        return "fetched"


@rdt.remote
class Holder:
    """An async actor whose constructor takes an RDT object."""

    def __init__(self, weights) -> None:
        self.total = float(sum(t.sum() for t in weights))

    async def get(self) -> float:
        return self.total


@pytest.fixture(scope="module")
def actors():
    # max_concurrency: the racing-return test reads on one thread while another returns
    p, c = Producer.options(max_concurrency=4).remote(), Consumer.remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


def test_lazy_conjugates_and_negations_arrive_resolved_over_every_path(actors):
    p, c = actors
    want = expected()
    big = torch.arange(BIG, dtype=torch.float32).to(torch.complex64) * (1 - 1j)
    for transport in ("auto", "object_store", "tcp"):
        refs = [getattr(p, f"lazy_{transport}").remote() for _ in range(2)]
        got = ray.get(c.values.remote(refs))
        for v in got.values():
            assert torch.equal(v["conj"], want["conj"]) and torch.equal(v["neg"], want["neg"]), transport
            assert torch.equal(v["big"], big), transport


def test_complex128_and_bool_over_the_object_store_arrive_exact(actors):
    p, c = actors
    got = ray.get(c.values.remote([p.odd_dtypes.remote()]))[0]
    assert torch.equal(got[0], torch.ones(3, dtype=torch.bool))
    assert torch.equal(got[1], torch.tensor([1 + 2j, 3 - 4j, 5j, 6, 7], dtype=torch.complex128))


def test_a_view_of_a_shared_storage_of_odd_size_arrives_every_time(actors):
    p, c = actors
    for _ in range(3):
        assert torch.equal(ray.get(c.values.remote([p.odd_storage.remote()]))[0], torch.arange(4.0))


@pytest.mark.parametrize("kind,said", [
    ("quantized", "returned tensor 1 is a quantized tensor (torch.qint8), which would move as its integers without its scale and zero point: return t.dequantize()"),
    ("nested", "returned tensor 1 is a nested tensor, not one block of bytes: return its tensors (t.unbind())"),
    ("meta", "returned tensor 1 is on the meta device, which holds no bytes to move"),
    ("wrapper", "returned tensor 1 is a Wrapper without memory of its own (a wrapper subclass"),
])
@pytest.mark.parametrize("transport", ["auto", "shm", "tcp", "object_store"])
@pytest.mark.parametrize("n", [8, 1 << 20])  # inline (auto), and prepared
def test_a_tensor_no_transport_can_move_is_refused_at_return_and_the_producer_lives(actors, kind, said, transport, n):
    # A quantized tensor moved as bytes arrived without its scale (inline) or killed the
    # producer (shm's copy); a wrapper subclass's bytes are at address 0.
    p, c = actors
    ref = p.unmovable.options(tensor_transport=transport).remote(kind, n, transport)
    with pytest.raises(rdt.TransportUnavailableError, match=re.escape(said)):
        rdt.get(ref, timeout=60)
    assert ray.get(c.values.remote([p.weights.remote(4)]), timeout=60)[0][1].sum() == 12.0  # both alive


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp", "object_store"])
@pytest.mark.parametrize("n", [64, 1 << 14])  # inline (auto), and prepared
def test_a_tied_weight_moves_once_and_lands_in_a_tied_or_untied_model(actors, transport, n):
    # A model with tied embeddings could not receive its own state dict into itself
    # (its two names share memory: refused as buffers that overlap).
    p, c = actors

    def ref(tie):
        return [p.tied.options(tensor_transport=transport).remote(tie, n)]

    assert ray.get(c.tied_value.remote(ref(True))) == (True, True, True)  # one tensor under both names
    assert ray.get(c.into_tied.remote(ref(True), True, True, n)) == (True, True)  # written once
    assert ray.get(c.into_tied.remote(ref(True), False, True, n)) == (True, True)  # copied to the head's own
    assert ray.get(c.into_tied.remote(ref(False), False, False, n)) == (True, False)
    said = ray.get(c.into_tied.remote(ref(False), True, False, n))  # the model cannot hold two tensors there
    assert said.startswith("into= tensor 0 (into['emb.weight']) and tensor 3 (into['head.weight']) share memory"), said
    assert "tie them there too" in said, said


def test_container_subclasses_keep_their_class_and_attributes(actors):
    p, _ = actors
    v = rdt.get(p.containers.remote())
    assert type(v["cfg"]) is Config and v["cfg"].version == 3 and torch.equal(v["cfg"]["w"], torch.ones(2))
    assert type(v["batch"]) is Batch and v["batch"].tag == "t" and v["batch"][1] == "x"
    assert type(v["dd"]) is collections.defaultdict and v["dd"]["missing"] == 0


@pytest.mark.parametrize("n", [8, 1 << 20])  # inline, and shm
def test_parameters_receive_into_as_a_weight_sync_passes_them(actors, n):
    p, c = actors
    assert ray.get(c.into_params.remote([p.weights.remote(n)], n)) == [2.0 * n, 3.0 * n, True]


def test_into_buffers_that_share_memory_are_refused_naming_the_fix(actors):
    p, c = actors
    expanded, twice, overlapping = ray.get(c.into_refused.remote([p.weights.remote(8)], 8))
    assert "into= tensor 0 has elements that share memory" in expanded and "torch.empty_like" in expanded
    assert overlapping == "into= tensors 0 and 1 share memory: each of the object's tensors needs a buffer of its own"
    assert twice.startswith(overlapping + " (one tensor under two names, as tied weights are") and "tie them there too" in twice


def test_an_async_actor_takes_rdt_objects_in_its_constructor(actors):
    p, _ = actors
    h = Holder.remote(p.weights.remote(4))
    try:
        assert ray.get(h.get.remote(), timeout=60) == 20.0
    finally:
        ray.kill(h)


def test_free_of_a_ref_on_a_loop_says_to_await_it_instead_of_hanging(actors):
    p, c = actors
    said = ray.get(c.free_on_loop.remote([p.weights.remote(1 << 20)]), timeout=30)
    assert "rdt.free(await ref)" in said


def test_a_failed_fetch_all_lets_the_producer_free_every_object_without_a_collection(actors):
    p, c = actors
    healthy, freed = p.weights.remote(1 << 20), p.weights.remote(1 << 20)
    rdt.free(freed)
    wait_until(lambda: ray.get(p.held.remote()) == 1, 10)
    assert ray.get(c.fail_all_without_gc.remote([healthy, freed])) == "ObjectFreedError"
    del healthy, freed
    wait_until(lambda: ray.get(p.held.remote()) == 0, 10, lambda: f"{ray.get(p.held.remote())} objects held")


def test_a_shared_storage_is_never_moved_by_a_return_racing_a_reader(actors):
    # Moving a storage into shared memory freed its old memory under a concurrent reader
    # (the producer crashed); storages stay where the user put them. The module's producer
    # (max_concurrency=4) serves it: its `w` is made on first use and returned by this test only.
    b, _ = actors
    ptr = ray.get(b.where.remote())
    reading = b.read.remote(20)
    for _ in range(4):
        assert float(rdt.get(b.publish.remote()).sum()) == 16 << 20
    assert ray.get(reading, timeout=60) == 20.0 * (16 << 20)
    assert ray.get(b.where.remote()) == ptr
    wait_until(lambda: ray.get(b.held.remote()) == 0, 10)  # alive, and left as it was found
