"""What a user of Ray's RDT does, done here (issue 32): each test is the Ray scenario,
ported as a migrating user would write it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import ray
import torch
from conftest import wait_until

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

try:
    from tensordict import TensorDict  # an optional test dependency (pip install tensordict)
except ImportError:
    TensorDict = None
needs_tensordict = pytest.mark.skipif(TensorDict is None, reason="tensordict is not installed: pip install tensordict")

N = 1 << 18  # float32 elements: 1 MiB a tensor

Pair = collections.namedtuple("Pair", "obs act")


@dataclasses.dataclass
class Step:
    obs: torch.Tensor
    reward: float


class Holder:
    """A user's own class holding a tensor (not a dataclass): pickled with its tensor left out."""

    def __init__(self, t: torch.Tensor, note: str) -> None:
        self.t = t
        self.note = note


class Locked:
    """Holds a tensor and something no pickler can take."""

    def __init__(self) -> None:
        self.t = torch.ones(2)
        self.lock = threading.Lock()


def batch(n: int):
    return TensorDict(
        {"obs": torch.arange(n, dtype=torch.float32), "nested": {"act": torch.full((n, 2), 2.0)}}, batch_size=[n]
    )


@rdt.remote
class Sender:
    def __init__(self) -> None:
        self.bodies = 0
        if TensorDict is not None:  # its first import holds the GIL ~3 s: not during a call
            import tensordict  # noqa: F401

    @rdt.method(tensor_transport="nixl")
    def td_nixl(self, n: int):
        return batch(n)

    @rdt.method(tensor_transport="shm")
    def td_shm(self, n: int):
        return batch(n)

    @rdt.method(tensor_transport="nixl")
    def containers(self, n: int):
        t = torch.arange(n, dtype=torch.float32)
        return {"pair": Pair(t, t + 1), "step": Step(t * 2, 0.5), "mine": Holder(t * 3, "x"), "set": {7}}

    @rdt.method(tensor_transport="nixl")
    def locked(self):
        return {"x": Locked()}

    @rdt.method(tensor_transport="nixl")
    def weights(self, n: int, *, scale: float = 1.0) -> torch.Tensor:
        return torch.full((n,), scale)

    @rdt.method(tensor_transport="nixl", num_returns=2)
    def two(self, n: int):
        return torch.ones(n), torch.zeros(n)

    @rdt.method(tensor_transport="gloo")
    def gloo_weights(self, n: int) -> torch.Tensor:
        self.bodies += 1
        return torch.full((n,), 5.0)

    def bodies_run(self) -> int:
        return self.bodies

    @torch.no_grad()
    @rdt.method(tensor_transport="shm")
    def inference(self):  # a decorator above @rdt.method: it runs on each call
        return {"grad": torch.tensor(torch.is_grad_enabled())}

    def own_weights(self, n: int):
        """The actor calling its own producer, as under Ray: the method's value, nothing kept."""
        before = rdt.store_stats()["objects"]
        w = self.weights(n, scale=2.0)
        return type(w).__name__, w.sum().item(), rdt.store_stats()["objects"] - before

    def total(self, t: torch.Tensor) -> float:  # a ref this actor made, passed back to it
        return t.sum().item()

    def plain(self) -> torch.Tensor:
        return torch.ones(2)

    def held(self) -> dict:
        s = rdt.store_stats()
        return {"objects": s["objects"], "bytes": s["bytes"]}


@rdt.remote
class Receiver:
    def __init__(self) -> None:
        if TensorDict is not None:
            import tensordict  # noqa: F401

    async def ping(self) -> str:
        return "pong"

    async def fetch_over(self, refs, transport):
        """Fetch refs[0] asking for `transport`: its sum, and the transports this process's fetches used."""
        before = dict(rdt.store_stats()["fetches"])
        value = await rdt.fetch(refs[0], tensor_transport=transport)
        return value.sum().item(), used_since(before)

    async def sums(self, td):
        return type(td).__name__, list(td.batch_size), td["obs"].sum().item(), td["nested", "act"].sum().item()


def used_since(before: dict) -> dict:
    after = rdt.store_stats()["fetches"]
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


@pytest.fixture(scope="module")
def pair():
    s, r = Sender.remote(), Receiver.remote()
    ray.get([s.held.remote(), r.ping.remote()])
    yield s, r
    for a in (s, r):
        ray.kill(a)


@needs_tensordict
@pytest.mark.parametrize("method", ["td_nixl", "td_shm"])
def test_a_tensordict_s_tensors_ride_the_transport_and_stay_with_the_producer(pair, method):
    s, r = pair
    ref = getattr(s, method).remote(N)
    obj = ray.get(ref)
    transport = method.split("_")[1]
    assert f"2 tensor(s) [float32[{N}]@cpu, float32[{N}, 2]@cpu], {3 * 4 * N} bytes, transport={transport}" in repr(obj)
    assert ray.get(s.held.remote()) == {"objects": 1, "bytes": 3 * 4 * N}
    assert ray.get(r.sums.remote(ref)) == ("TensorDict", [N], float(N * (N - 1) // 2), 4.0 * N)
    td = rdt.get(ref)
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([N])
    assert torch.equal(td["obs"], torch.arange(N, dtype=torch.float32))
    assert torch.equal(td["nested", "act"], torch.full((N, 2), 2.0))
    del ref, obj, td
    wait_until(lambda: ray.get(s.held.remote())["objects"] == 0, 10)


def test_named_tuples_dataclasses_sets_and_a_user_s_class_are_unpacked(pair):
    s, _ = pair
    ref = s.containers.remote(8)
    assert "4 tensor(s)" in repr(ray.get(ref))
    out = rdt.get(ref)
    t = torch.arange(8, dtype=torch.float32)
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].act, t + 1)
    assert isinstance(out["step"], Step) and out["step"].reward == 0.5 and torch.equal(out["step"].obs, t * 2)
    assert isinstance(out["mine"], Holder) and out["mine"].note == "x" and torch.equal(out["mine"].t, t * 3)
    assert out["set"] == {7}


def test_a_container_whose_tensors_cannot_be_taken_out_is_refused_naming_the_fix(pair):
    s, _ = pair
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(s.locked.remote())
    assert isinstance(info.value.cause, TypeError)
    assert "the value holds a Locked with tensors that cannot be pickled" in str(info.value.cause)
    assert "return them in a dict, list, tuple, named tuple or dataclass instead" in str(info.value.cause)


@ray.remote
class PlainCaller:
    """A plain Ray actor that was handed an rdt actor: its per-call choice reaches rdt_async too."""

    def call(self, sender, transport):
        obj = ray.get(sender.weights.options(tensor_transport=transport).remote(4, scale=3.0))
        return obj.transport, rdt.get(obj).tolist()


@pytest.mark.parametrize("transport", ["shm", "object_store", "tcp"])
def test_a_call_picks_its_transport_as_with_ray_options(pair, transport):
    s, _ = pair
    ref = s.weights.options(tensor_transport=transport).remote(N, scale=2.0)
    obj = ray.get(ref)
    assert obj.transport == transport and f"transport={transport}," in repr(obj)
    assert ray.get(s.held.remote())["bytes"] >= 4 * N  # kept by the producer, as with its own transport
    assert torch.equal(rdt.get(ref), torch.full((N,), 2.0))
    assert ray.get(s.weights.remote(4)).transport == "nixl"  # the next call: the method's own again
    del ref, obj
    wait_until(lambda: ray.get(s.held.remote())["objects"] == 0, 10)


def test_a_per_call_transport_holds_for_every_return_and_from_any_caller(pair):
    s, _ = pair
    a, b = s.two.options(tensor_transport="shm", num_returns=2).remote(8)
    assert [ray.get(a).transport, ray.get(b).transport] == ["shm", "shm"]
    assert rdt.get(a).sum().item() == 8.0 and rdt.get(b).sum().item() == 0.0
    caller = PlainCaller.remote()
    assert ray.get(caller.call.remote(s, "object_store")) == ("object_store", [3.0] * 4)
    ray.kill(caller)


def test_a_per_call_transport_that_rdt_async_cannot_honour_is_refused_at_the_call(pair):
    s, _ = pair
    with pytest.raises(TypeError, match=r"plain.options\(tensor_transport='nixl'\): plain is not an @rdt.method"):
        s.plain.options(tensor_transport="nixl")
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'carrier-pigeon'; available: .*nixl"):
        s.weights.options(tensor_transport="carrier-pigeon")
    # Case-sensitive, as @rdt.method, fetch and put are (before: lowercased here only).
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'SHM' \(did you mean 'shm'\?\)"):
        s.weights.options(tensor_transport="SHM")
    # rdt_async's own group, for one call (before: the call ran there, beside the transfers).
    with pytest.raises(ValueError, match=r"weights.options\(...\): the concurrency group 'rdt' is rdt_async's own"):
        s.weights.options(concurrency_group="rdt")


def test_a_producer_called_by_its_own_actor_returns_its_value_and_decorators_above_it_run(pair):
    s, _ = pair
    # As under Ray: the tensor itself, nothing kept (before: an RDTObject, one object kept per call).
    assert ray.get(s.own_weights.remote(4)) == ("Tensor", 8.0, 0)
    # @torch.no_grad() above @rdt.method (before: dropped, the body saw grad enabled).
    assert rdt.get(s.inference.remote())["grad"].item() is False


def test_what_would_hand_transfers_to_ray_s_own_rdt_is_refused_at_decoration():
    class Both:
        @rdt.method
        def w(self):
            return torch.ones(1)

    with pytest.raises(TypeError, match=r"@rdt.remote\(enable_tensor_transport=True\) on Both would hand its transfers "
                       r"to Ray's own RDT, bypassing rdt_async: drop the option"):
        rdt.remote(enable_tensor_transport=True)(Both)

    class RayMethod:
        @ray.method(tensor_transport="nixl")
        def w(self):
            return torch.ones(1)

    with pytest.raises(TypeError, match=r"RayMethod.w has @ray.method\(tensor_transport='nixl'\), which would hand its "
                       r"return to Ray's own RDT, bypassing rdt_async: use @rdt.method\(tensor_transport='nixl'\)"):
        rdt.remote(RayMethod)


def test_the_consumer_asks_for_the_object_store_as_ray_get_use_object_store(pair):
    s, r = pair
    ref = s.weights.remote(N, scale=2.0)  # nixl
    before = dict(rdt.store_stats()["fetches"])
    assert torch.equal(rdt.get(ref, tensor_transport="object_store"), torch.full((N,), 2.0))
    assert used_since(before) == {"object_store": 1}
    assert ray.get(r.fetch_over.remote([ref], "object_store")) == (2.0 * N, {"object_store": 1})
    assert ray.get(r.fetch_over.remote([ref], "auto"))[0] == 2.0 * N  # auto among what the producer prepared
    with pytest.raises(rdt.TransportUnavailableError) as info:
        rdt.get(ref, tensor_transport="shm")
    assert str(info.value).endswith(
        f"fetch(..., tensor_transport='shm') of {ray.get(ref).obj_id} (held by {ray.get(ref).producer.label}): the "
        "producer did not prepare shm for this object, so it cannot serve it; it serves nixl, object_store: ask for "
        "one of them, or produce it with tensor_transport='shm'"
    )
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'pigeon'; available: "):
        rdt.get(ref, tensor_transport="pigeon")


def test_a_small_object_asked_for_over_the_object_store_comes_from_its_ref(sync_producer, async_consumer):
    ref = sync_producer.make.remote(256, 3)  # auto: its bytes ride in the ref, and the producer keeps nothing
    want = torch.randn(256, generator=torch.Generator().manual_seed(3))
    before = dict(rdt.store_stats()["fetches"])
    assert torch.equal(rdt.get(ref, tensor_transport="object_store")["w"], want)
    assert used_since(before) == {"inline": 1}  # (its object-store copy is the ref)
    assert torch.equal(ray.get(async_consumer.fetch.remote([ref], tensor_transport="object_store"))["w"], want)


def test_a_gloo_method_of_an_actor_in_no_group_is_refused_before_its_body_runs(pair):
    s, _ = pair
    for name, call in (("gloo_weights", s.gloo_weights), ("weights", s.weights.options(tensor_transport="gloo"))):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(call.remote(8))
        assert isinstance(info.value.cause, rdt.TransportUnavailableError)
        message = str(info.value.cause)
        assert message.startswith(
            f"Sender.{name} produces over tensor_transport='gloo', and was refused before it ran: this process "
            "is in no gloo group, so no consumer could fetch over gloo"
        ), message
        assert "create_collective_group(actors, backend='gloo'), or produce with tensor_transport='auto'" in message
        assert "fetch" not in message.split(":")[0]  # (said as what happened: no fetch did)
    assert ray.get(s.bodies_run.remote()) == 0


def test_a_consumer_in_the_group_or_outside_it_asks_for_what_it_shares(pair):
    s, r = pair
    group = rdt.create_collective_group([s, r], backend="gloo")
    try:
        ref = s.gloo_weights.remote(8)
        assert ray.get(r.fetch_over.remote([ref], None)) == (40.0, {"gloo": 1})  # the producer's choice
        assert ray.get(r.fetch_over.remote([ref], "object_store")) == (40.0, {"object_store": 1})
        with pytest.raises(rdt.TransportUnavailableError, match=r"tensor_transport='gloo'\) of .*: this process shares "
                           r"no gloo group with the producer; create one with rdt.create_collective_group"):
            rdt.get(ref, tensor_transport="gloo")  # the driver is in no group
        assert rdt.get(ref, tensor_transport="object_store").sum().item() == 40.0
    finally:
        rdt.destroy_collective_group(group)


def test_a_group_of_one_lets_a_producer_pass_refs_to_itself(pair):
    s, _ = pair
    group = rdt.create_collective_group([s], backend="gloo")
    try:
        ref = s.gloo_weights.remote(8)
        assert ray.get(ref).transport == "gloo"
        assert ray.get(s.total.remote(ref)) == 40.0  # the producer itself: the tensors themselves
        before = dict(rdt.store_stats()["fetches"])
        assert rdt.get(ref).sum().item() == 40.0  # outside the group: the object store
        assert used_since(before) == {"object_store": 1}
    finally:
        rdt.destroy_collective_group(group)
