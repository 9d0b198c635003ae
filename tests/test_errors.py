"""Bad input fails where the mistake is made, with a message that names the fix."""

from __future__ import annotations

import asyncio
import re

import pytest
import ray
import torch
from helpers import SyncProducer

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")


def test_unknown_transport_fails_at_decoration_naming_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'nvlink'; available: auto, inline, shm, object_store"):

        @rdt.method(tensor_transport="nvlink")
        def f(self):
            pass

    with pytest.raises(ValueError, match="unknown tensor_transport"):
        rdt.put(torch.ones(1), tensor_transport="nope")


def test_remote_refuses_functions_and_the_reserved_group():
    with pytest.raises(TypeError, match=re.escape("use ray.remote")):

        @rdt.remote
        def task():
            pass

    with pytest.raises(ValueError, match="'rdt' is rdt_async's own"):

        @rdt.remote(concurrency_groups={"rdt": 2})
        class A:
            pass


def test_unsupported_device_fails_when_the_value_is_returned():
    p = SyncProducer.remote()
    with pytest.raises(rdt.TransportUnavailableError, match=r"transport 'shm' moves tensors on cpu, not meta"):
        ray.get(p.value_shm.remote(torch.empty(3, device="meta")))
    with pytest.raises(rdt.TransportUnavailableError, match="not meta"):
        ray.get(p.value.remote(torch.empty(3, device="meta")))
    with pytest.raises(rdt.TransportUnavailableError, match=r"tensor_transport='auto' cannot move these tensors: .*to_dense\(\)"):
        ray.get(p.value.remote(torch.eye(3).to_sparse()))
    assert ray.get(p.stats.remote())["objects"] == 0
    ray.kill(p)


def test_fetch_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="ObjectRef or an RDTObject"):
        rdt.get(42)
    with pytest.raises(TypeError, match="RDT object"):
        rdt.free(ray.put(1))


def test_sync_method_of_an_async_actor_asks_to_be_async():
    p = SyncProducer.remote()

    @rdt.remote
    class Mixed:
        async def ok(self):
            return 1

        def sync_consumer(self, value):
            return value

    m = Mixed.remote()
    with pytest.raises(RuntimeError, match="make the method `async def`"):
        ray.get(m.sync_consumer.remote(p.value.remote(torch.ones(1))))
    ray.kill(p)


def test_explicit_inline_refuses_large_values():
    p = SyncProducer.remote()

    @rdt.remote
    class Inliner:
        @rdt.method(tensor_transport="inline")
        def big(self):
            return torch.ones(1 << 19)

    with pytest.raises(rdt.TransportUnavailableError, match=r"at most 1048576 bytes.*use tensor_transport='auto' or 'shm'"):
        ray.get(Inliner.remote().big.remote())
    ray.kill(p)


@rdt.remote
class Failing:
    @rdt.method(tensor_transport="shm")
    def boom(self):
        raise ValueError("boom: bad input")

    @rdt.method(tensor_transport="shm", num_returns=2)
    def three(self):
        return torch.ones(1), torch.ones(2), torch.ones(3)

    async def fetch_boom(self, refs):
        try:
            await rdt.fetch(refs[0])
        except ValueError as exc:
            return f"ValueError {exc}"


def test_what_a_producer_method_raises_reaches_the_consumer_as_ray_get_raises_it():
    p = Failing.remote()
    with pytest.raises(ValueError, match="boom: bad input") as info:
        rdt.get(p.boom.remote(), timeout=30)
    assert isinstance(info.value, ray.exceptions.RayTaskError)  # as ray.get raises it
    assert "boom: bad input" in ray.get(p.fetch_boom.remote([p.boom.remote()]), timeout=30)
    a, _ = p.three.remote()
    with pytest.raises(ValueError, match=r"num_returns=2: return a tuple of 2 values, not tuple of 3"):
        rdt.get(a, timeout=30)
    ray.kill(p)


def test_our_errors_raised_in_another_process_arrive_as_themselves():
    from rdt_async._errors import translate

    cause = rdt.ObjectFreedError("object x1 was freed before it was fetched", obj_id="x1")
    remote = ray.exceptions.RayTaskError("serve_send", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(remote, rdt.ObjectFreedError)  # Ray's dual class: `except` caught it, its name lied
    err = translate(remote, "shm fetch of x1", "x1")
    assert type(err) is rdt.ObjectFreedError and err.obj_id == "x1"
    assert str(err) == "object x1 was freed before it was fetched"


def test_bad_fetch_arguments_fail_at_the_call_naming_the_fix():
    p = SyncProducer.remote()
    ref = p.value_shm.remote(torch.ones(4))
    with pytest.raises(TypeError, match=r"into= holds no tensor \(list \[5\]\)"):
        rdt.get(ref, into=[5])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no usable CUDA device .* fetch to 'cpu'"):
            rdt.get(ref, device="cuda")
    with pytest.raises(TypeError, match="takes a tensor this process returned or put, not str"):
        asyncio.run(rdt.wait_tensor_freed("notatensor"))
    assert rdt.get(ref, device="cpu").tolist() == [1.0] * 4
    ray.kill(p)


def test_generator_methods_are_refused_at_decoration():
    with pytest.raises(TypeError, match=r"generator .*gen a producer: Ray 2.60 loses .* return a list"):

        @rdt.method(tensor_transport="shm")
        def gen(self):
            yield torch.ones(1)

    with pytest.raises(TypeError, match=r"generator .*agen a producer"):

        @rdt.method
        async def agen(self):
            yield torch.ones(1)


def test_rdt_method_in_a_plain_ray_class_refuses_at_the_call():
    @ray.remote
    class Plain:
        @rdt.method
        def make(self):
            return torch.ones(2)

        @rdt.method(tensor_transport="shm")
        async def make_async(self):
            return torch.ones(2)

        def ping(self):
            return "pong"

    p = Plain.remote()
    for call in (p.make, p.make_async):
        with pytest.raises(TypeError, match=r"runs in a class decorated with @ray.remote.*decorate Plain with @rdt.remote"):
            ray.get(call.remote())
    assert ray.get(p.ping.remote()) == "pong"
    ray.kill(p)


def test_a_two_sided_transport_without_a_group_refuses_at_return():
    @rdt.remote
    class Lonely:
        @rdt.method(tensor_transport="gloo")
        def make(self):
            return torch.ones(2)

    a = Lonely.remote()
    with pytest.raises(rdt.TransportUnavailableError, match=r"in no gloo group.*create_collective_group\(actors, backend='gloo'\)"):
        ray.get(a.make.remote())
    with pytest.raises(rdt.TransportUnavailableError, match="in no gloo group"):
        rdt.put(torch.ones(2), tensor_transport="gloo")  # the driver is in none either
    ray.kill(a)


def test_method_misuses_are_refused_at_decoration_naming_the_fix():
    with pytest.raises(TypeError, match=r"@rdt.method\('shm'\): name the transport, @rdt.method\(tensor_transport='shm'\)"):
        rdt.method("shm")
    with pytest.raises(TypeError, match=r"not a staticmethod: drop the @staticmethod"):

        class A:
            @rdt.method
            @staticmethod
            def make():
                return torch.ones(1)


def test_ray_method_options_above_rdt_method_are_kept():
    """`@ray.method(num_returns=2)` over `@rdt.method` works as under it."""

    @rdt.remote
    class Two:
        @ray.method(num_returns=2)
        @rdt.method(tensor_transport="shm")
        def pair(self):
            return torch.ones(2), torch.full((3,), 2.0)

    p = Two.remote()
    try:
        a, b = p.pair.remote()
        assert rdt.get(a).tolist() == [1.0, 1.0] and rdt.get(b).tolist() == [2.0] * 3
    finally:
        ray.kill(p)
