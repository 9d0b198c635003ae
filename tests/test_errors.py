"""Bad input fails where the mistake is made, with a message that names the fix."""

from __future__ import annotations

import asyncio
import re

import pytest
import ray
import torch
from conftest import wait_until
from helpers import checksum

import rdt_async as rdt
from rdt_async.transports import _registry

pytestmark = pytest.mark.usefixtures("ray_session")


@rdt.remote
class SyncTools:
    """A plain (sync) actor that produces tensors: every sync case of the module, one process."""

    @rdt.method
    def make(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(n, generator=g), "step": seed, "meta": ["x", (1, 2)]}

    @rdt.method
    def value(self, v):
        return v

    @rdt.method(tensor_transport="shm")
    def value_shm(self, v):
        return v

    @rdt.method(tensor_transport="inline")
    def big(self):
        return torch.ones(1 << 19)

    @rdt.method(tensor_transport="gloo")  # this module makes no group
    def make_gloo(self):
        return torch.ones(2)

    @ray.method(num_returns=2)
    @rdt.method(tensor_transport="shm")
    def pair(self):
        return torch.ones(2), torch.full((3,), 2.0)

    def object_ids(self) -> list[str]:
        from rdt_async._store import store

        return store.object_ids()

    def ping(self) -> str:
        return "pong"


@rdt.remote
class AsyncTools:
    """An async actor: every async case of the module, one process."""

    async def ok(self):
        return 1

    def sync_consumer(self, value):  # a sync method of an async actor
        return value

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

    async def checksums(self, *values):
        return [checksum(v) for v in values]

    async def total(self, value) -> float:  # fetched before the method runs
        return float(value["w"].sum())

    async def fetch_total(self, refs) -> float:
        return float((await rdt.fetch(refs[0]))["w"].sum())

    async def ping(self) -> str:
        return "pong"

    # A producer fetching back what it made: it records the warnings it shows meanwhile.
    @rdt.method(tensor_transport="object_store")  # sent from these tensors when another process fetches
    def make(self):
        self.t = torch.arange(4.0)
        return self.t

    async def record(self, on: bool = True) -> None:
        import warnings

        if not hasattr(self, "shown"):
            self.shown = warnings.showwarning, warnings.filters[:]
        warnings.showwarning, warnings.filters[:] = self.shown[0], self.shown[1]  # (as it was: off)
        self.caught = []
        if on:
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, category, filename, lineno, *a: self.caught.append(
                (str(message), filename, lineno))

    async def take(self, value) -> bool:  # its argument is fetched before it runs
        return value is self.t

    async def fetch_all_back(self, refs) -> bool:
        values = await rdt.fetch_all(refs)
        return values[0] is self.t

    async def caught_warnings(self) -> list:
        return self.caught


@pytest.fixture(scope="module")
def tools(cluster):
    """The module's two shared actors, a sync and an async one (each test leaves them clean)."""
    s, a = SyncTools.remote(), AsyncTools.remote()
    yield s, a
    ray.kill(s)
    ray.kill(a)


@pytest.fixture
def sync_tools(tools):
    yield tools[0]
    assert ray.get(tools[0].ping.remote()) == "pong"


@pytest.fixture
def async_tools(tools):
    yield tools[1]
    assert ray.get(tools[1].ping.remote()) == "pong"


def test_unknown_transport_fails_at_decoration_naming_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'nvlink'; available: auto, inline, shm, object_store"):

        @rdt.method(tensor_transport="nvlink")
        def f(self):
            pass

    with pytest.raises(ValueError, match="unknown tensor_transport"):
        rdt.put(torch.ones(1), tensor_transport="nope")
    # Names are case-sensitive everywhere (a registered "MyNet" is not "mynet"); a near
    # miss says which one was meant. Before: the per-call option lowercased, nothing else did.
    for refuse in (lambda: rdt.method(tensor_transport="NIXL"), lambda: rdt.put(torch.ones(1), tensor_transport="Shm")):
        with pytest.raises(ValueError, match=r"unknown tensor_transport '(NIXL|Shm)' \(did you mean '(nixl|shm)'\?\); available"):
            refuse()


def test_remote_refuses_functions_and_the_reserved_group():
    with pytest.raises(TypeError, match=re.escape("use ray.remote")):

        @rdt.remote
        def task():
            pass

    with pytest.raises(ValueError, match="'rdt' is rdt_async's own"):

        @rdt.remote(concurrency_groups={"rdt": 2})
        class A:
            pass


def test_a_class_returning_over_two_transports_that_clash_is_refused_at_decoration():
    # nixl and ucxx each load their own UCX build: one actor process can use only one, so
    # the other's returns would all fail (the first to warm up owns UCX).
    with pytest.raises(ValueError, match=re.escape(
        "Both.weights returns over 'nixl' and Both.grads over 'ucxx', which cannot load in one process "
        "(their native libraries clash): return one of them from an actor of another class"
    )):

        @rdt.remote
        class Both:
            @rdt.method(tensor_transport="nixl")
            def weights(self):
                pass

            @rdt.method(tensor_transport="ucxx")
            def grads(self):
                pass

    @rdt.remote  # either alone, or beside any other, is fine
    class One:
        @rdt.method(tensor_transport="ucxx")
        def grads(self):
            pass

        @rdt.method(tensor_transport="tcp")
        def weights(self):
            pass


def test_unsupported_device_fails_when_the_value_is_returned(sync_tools):
    p = sync_tools
    held = set(ray.get(p.object_ids.remote()))
    meta = "returned tensor 0 is on the meta device, which holds no bytes to move"  # whatever the transport
    with pytest.raises(rdt.TransportUnavailableError, match=meta):
        ray.get(p.value_shm.remote(torch.empty(3, device="meta")))
    with pytest.raises(rdt.TransportUnavailableError, match=meta):
        ray.get(p.value.remote(torch.empty(3, device="meta")))
    # A device a transport does not handle (meta is the one this CPU machine can make): its own refusal.
    with pytest.raises(rdt.TransportUnavailableError, match=r"transport 'shm' moves tensors on cpu, not meta"):
        _registry.transport("shm").check_tensors([torch.empty(3, device="meta")])
    with pytest.raises(rdt.TransportUnavailableError, match=r"tensor_transport='auto' cannot move these tensors: .*to_dense\(\)"):
        ray.get(p.value.remote(torch.eye(3).to_sparse()))
    assert set(ray.get(p.object_ids.remote())) <= held  # nothing kept for the refused values


def test_fetch_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="ObjectRef or an RDTObject"):
        rdt.get(42)
    refs = [ray.put(1), ray.put(2)]
    with pytest.raises(TypeError, match=re.escape("not list; for many, `[rdt.get(r) for r in refs]`, or `await rdt.fetch_all(refs)` on a loop")):
        rdt.get(refs)
    with pytest.raises(TypeError, match=re.escape("rdt.fetch() takes an ObjectRef or an RDTObject, not tuple; for many, `await rdt.fetch_all(refs)`")):
        asyncio.run(rdt.fetch(tuple(refs)))
    with pytest.raises(TypeError, match="RDT object"):
        rdt.free(ray.put(1))


def test_sync_method_of_an_async_actor_asks_to_be_async(sync_tools, async_tools):
    p, m = sync_tools, async_tools
    with pytest.raises(RuntimeError, match="make the method `async def`"):
        ray.get(m.sync_consumer.remote(p.value.remote(torch.ones(1))))


def test_explicit_inline_refuses_large_values(sync_tools):
    with pytest.raises(rdt.TransportUnavailableError, match=r"at most 1048576 bytes.*use tensor_transport='auto' or 'shm'"):
        ray.get(sync_tools.big.remote())


def test_what_a_producer_method_raises_reaches_the_consumer_as_ray_get_raises_it(async_tools):
    p = async_tools
    with pytest.raises(ValueError, match="boom: bad input") as info:
        rdt.get(p.boom.remote(), timeout=30)
    assert isinstance(info.value, ray.exceptions.RayTaskError)  # as ray.get raises it
    assert "boom: bad input" in ray.get(p.fetch_boom.remote([p.boom.remote()]), timeout=30)
    a, _ = p.three.remote()
    with pytest.raises(ValueError, match=r"num_returns=2: return a tuple of 2 values, not tuple of 3"):
        rdt.get(a, timeout=30)


def test_our_errors_raised_in_another_process_arrive_as_themselves():
    from rdt_async._errors import translate

    cause = rdt.ObjectFreedError("object x1 was freed before it was fetched", obj_id="x1")
    remote = ray.exceptions.RayTaskError("serve_send", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(remote, rdt.ObjectFreedError)  # Ray's dual class: `except` caught it, its name lied
    err = translate(remote, "shm fetch of x1", "x1")
    assert type(err) is rdt.ObjectFreedError and err.obj_id == "x1"
    assert str(err) == "object x1 was freed before it was fetched"


def test_bad_fetch_arguments_fail_at_the_call_naming_the_fix(sync_tools):
    p = sync_tools
    ref = p.value_shm.remote(torch.ones(4))
    with pytest.raises(TypeError, match=r"into= holds no tensor \(list \[5\]\)"):
        rdt.get(ref, into=[5])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no usable CUDA device .* fetch to 'cpu'"):
            rdt.get(ref, device="cuda")
    with pytest.raises(TypeError, match="takes a tensor this process returned or put, not str"):
        asyncio.run(rdt.wait_tensor_freed("notatensor"))
    assert rdt.get(ref, device="cpu").tolist() == [1.0] * 4


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


def test_a_two_sided_transport_without_a_group_refuses_at_return(sync_tools):
    with pytest.raises(rdt.TransportUnavailableError, match=r"in no gloo group.*create_collective_group\(actors, backend='gloo'\)"):
        ray.get(sync_tools.make_gloo.remote())
    with pytest.raises(rdt.TransportUnavailableError, match="in no gloo group"):
        rdt.put(torch.ones(2), tensor_transport="gloo")  # the driver is in none either


def test_method_misuses_are_refused_at_decoration_naming_the_fix():
    with pytest.raises(TypeError, match=r"@rdt.method\('shm'\): name the transport, @rdt.method\(tensor_transport='shm'\)"):
        rdt.method("shm")
    with pytest.raises(TypeError, match=r"not a staticmethod: drop the @staticmethod"):

        class A:
            @rdt.method
            @staticmethod
            def make():
                return torch.ones(1)


def test_decoration_refuses_what_would_fail_or_mislead_later_naming_the_fix():
    """Each of these was accepted at decoration before, then failed at the call (or never)."""

    def remote_of(body: dict, **options):
        return rdt.remote(**options)(type("Producer", (), body))

    # rdt_async's own groups: a method there would hold up transfers (before: accepted).
    for own in ("rdt", "rdt_publish"):
        with pytest.raises(ValueError, match=rf"@rdt.method: the concurrency group '{own}' is rdt_async's own .*declare one of yours"):
            rdt.method(concurrency_group=own)
    with pytest.raises(ValueError, match=r"Producer.train: the concurrency group 'rdt' is rdt_async's own"):
        remote_of({"train": ray.method(concurrency_group="rdt")(lambda self: None)})
    # A group the class does not declare (before: a bare AssertionError at .remote()).
    with pytest.raises(ValueError, match=re.escape(
        "Producer.weights runs in the concurrency group 'io', which its class does not declare (it declares 'side'): "
        "add it, @rdt.remote(concurrency_groups={'io': 1})"
    )):
        remote_of({"weights": rdt.method(concurrency_group="io")(lambda self: {})}, concurrency_groups={"side": 1})
    with pytest.raises(TypeError, match=r"concurrency_groups takes a dict of group names and their max concurrency, "
                                        r"such as concurrency_groups=\{'io': 2\}, not a list"):
        remote_of({}, concurrency_groups=["io"])  # before: "dictionary update sequence element #0 ..."
    # num_returns=0 on a producer, here or from a @ray.method above (before: accepted).
    with pytest.raises(ValueError, match=r"@rdt.method\(num_returns=0\): nothing the method returns would reach a consumer"):
        rdt.method(num_returns=0)
    with pytest.raises(ValueError, match=r"Producer.f is an @rdt.method with num_returns=0"):
        remote_of({"f": ray.method(num_returns=0)(rdt.method(lambda self: {}))})
    # What Ray would call without an instance, over a producer (before: accepted, then a
    # TypeError about a missing `self` at each call).
    for kind in (staticmethod, classmethod, property):
        with pytest.raises(TypeError, match=rf"Producer.f is a {kind.__name__} over an @rdt.method, which Ray cannot call "
                                            rf"as a producer: drop the @{kind.__name__}"):
            remote_of({"f": kind(rdt.method(lambda self: {}))})
    # The class under both decorators, and @rdt.method on a class (before: a misleading
    # "decorates actor classes, not ActorClass(A)", and a function handed back).
    with pytest.raises(TypeError, match=r"@rdt.remote over @ray.remote on Producer: drop the @ray.remote"):
        rdt.remote(ray.remote(type("Producer", (), {})))
    with pytest.raises(TypeError, match=r"@rdt.method marks methods, not the class Producer: decorate the class with @rdt.remote"):
        rdt.method(type("Producer", (), {}))


def test_ray_method_options_above_rdt_method_are_kept(sync_tools):
    """`@ray.method(num_returns=2)` over `@rdt.method` works as under it (SyncTools.pair)."""
    a, b = sync_tools.pair.remote()
    assert rdt.get(a).tolist() == [1.0, 1.0] and rdt.get(b).tolist() == [2.0] * 3


def test_get_refuses_a_timeout_that_is_not_seconds_at_the_call(sync_tools):
    # Before: -5 reported a timeout, '5' "unsupported operand type(s) for +: 'float' and 'str'".
    p = sync_tools
    ref = p.value_shm.remote(torch.ones(4))
    for bad in (-5, -0.001, float("nan")):
        with pytest.raises(ValueError, match=r"rdt\.get\(timeout=.*\): a timeout is seconds >= 0 \(0: do not wait\), or None"):
            rdt.get(ref, timeout=bad)
    for bad in ("5", True, [5]):
        with pytest.raises(TypeError, match=r"rdt\.get\(timeout=\.\.\.\) takes seconds as a number, or None .*; not "):
            rdt.get(ref, timeout=bad)
    assert rdt.get(ref, timeout=float("inf")).tolist() == [1.0] * 4  # no limit
    assert rdt.get(ref, timeout=30).tolist() == [1.0] * 4
    t = torch.ones(2)
    with pytest.raises(ValueError, match=r"rdt\.wait_tensor_freed_sync\(timeout=-1\): a timeout is seconds >= 0"):
        rdt.wait_tensor_freed_sync(t, timeout=-1)
    with pytest.raises(TypeError, match=r"rdt\.wait_tensor_freed_sync\(timeout=\.\.\.\) takes seconds as a number"):
        rdt.wait_tensor_freed_sync(t, timeout="1")


def test_the_async_verbs_refuse_a_timeout_at_the_call_naming_asyncio_timeout():
    # Before: "fetch() got an unexpected keyword argument 'timeout'", no word of asyncio.timeout.
    import inspect

    ref = ray.put(1)
    with pytest.raises(TypeError, match=re.escape(
            "rdt.fetch() takes no timeout: the caller bounds it, `async with asyncio.timeout(5): await rdt.fetch(...)`")):
        rdt.fetch(ref, timeout=5)  # at the call: nothing to await
    with pytest.raises(TypeError, match=re.escape("`async with asyncio.timeout(2.5): await rdt.fetch_all(...)`")):
        rdt.fetch_all([ref], timeout=2.5)
    with pytest.raises(TypeError, match=re.escape("`async with asyncio.timeout(1): async for i, value in rdt.as_completed(...)`")):
        rdt.as_completed([ref], timeout=1)
    # Still coroutine functions with their own signatures (the docs and tools read them).
    assert asyncio.iscoroutinefunction(rdt.fetch) and asyncio.iscoroutinefunction(rdt.fetch_all)
    assert str(inspect.signature(rdt.fetch)) == "(x: 'Any', /, *, device: 'str | torch.device | None' = None, into: 'Any' = None, tensor_transport: 'str | None' = None) -> 'Any'"
    assert asyncio.run(rdt.fetch(ref)) == 1


def test_fetch_all_and_as_completed_refuse_a_single_ref_naming_fetch():
    ref = ray.put(1)

    async def main():
        with pytest.raises(TypeError, match=r"rdt\.fetch_all\(\) takes an iterable of ObjectRefs or RDTObjects, not ObjectRef; "
                                            r"for one, `await rdt\.fetch\(ref\)`"):
            await rdt.fetch_all(ref)
        with pytest.raises(TypeError, match=r"rdt\.as_completed\(\) takes an iterable .*, not str"):
            async for _ in rdt.as_completed("refs"):
                pass
        # Before: "rdt.fetch() takes an ObjectRef or an RDTObject, not str" (it fetched the keys).
        with pytest.raises(TypeError, match=r"rdt\.fetch_all\(\) takes .*, not a dict \(that would fetch its keys\): "
                                            r"pass d\.values\(\)"):
            await rdt.fetch_all({"w": ref})
        return await rdt.fetch_all([ref, ref])

    assert asyncio.run(main()) == [1, 1]


@ray.remote
def _plain_consumer(value, use: str):
    """A task of plain Ray, handed an rdt ref: it sees the RDTObject, as documented."""
    if use == "index":
        return value["w"]
    if use == "iter":
        return list(value)
    if use == "len":
        return len(value)
    if use == "attr":
        return value.shape
    return [hasattr(value, "shape"), bool(value), value.nbytes, type(value).__name__]


def test_a_plain_ray_consumer_using_an_rdt_object_as_its_value_is_told_to_fetch_it(sync_tools):
    # Before: "'RDTObject' object is not subscriptable", "object of type 'RDTObject' has no len()", ...
    p = sync_tools
    ref = p.make.remote(8)
    fix = (r"it is a reference to 1 tensor\(s\) held by actor \w{8}, not the value\. Get the value with "
           r"`await rdt\.fetch\(obj\)` \(`rdt\.get\(obj\)` in sync code\), or make the receiving actor an "
           r"`@rdt\.remote` actor: its methods receive top-level RDT arguments already fetched")
    for use, what in (("index", r"\['w'\]"), ("iter", "iteration"), ("len", r"len\(\)"), ("attr", r"\.shape")):
        with pytest.raises(TypeError, match=f"{what} of an RDTObject: {fix}"):
            ray.get(_plain_consumer.remote(ref, use), timeout=60)
    # hasattr, truth, its own attributes and pickling still work as for any object
    assert ray.get(_plain_consumer.remote(ref, "other"), timeout=60) == [False, True, 8 * 4, "RDTObject"]
    obj = ray.get(ref)
    import copy
    import pickle

    for copied in (copy.copy(obj), pickle.loads(pickle.dumps(obj))):
        assert (copied.obj_id, copied.specs, copied.producer) == (obj.obj_id, obj.specs, obj.producer)
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        obj._private  # noqa: B018
    assert rdt.get(obj)["w"].shape == (8,)


@rdt.remote
class _TcpProducer:
    @rdt.method(tensor_transport="tcp")
    def make(self):
        return {"w": torch.full((1 << 18,), 2.0)}

    def pid(self) -> int:
        import os

        return os.getpid()


def _gone(actor, pid: int) -> bool:
    """Ray has the actor dead and its process is gone (its sockets closed)."""
    import os

    try:
        ray.get(actor.pid.remote(), timeout=10)
    except ray.exceptions.GetTimeoutError:
        pass
    except ray.exceptions.RayActorError:
        return not os.path.exists(f"/proc/{pid}")
    return False


def test_peer_died_inside_an_actor_shows_one_chain_the_native_cause(async_tools):
    # Before: three chained tracebacks (the socket's reset, tcp's internal _Stale retry, the
    # refused reconnect), each with rdt_async's internal frames.
    p, c = _TcpProducer.remote(), async_tools  # a fresh producer: it is killed
    pid = ray.get(p.pid.remote())
    assert ray.get(c.fetch_total.remote([p.make.remote()]), timeout=60) == 2.0 * (1 << 18)  # a connection to reuse
    refs = [p.make.remote(), p.make.remote()]
    ray.wait(refs, num_returns=2, timeout=60)
    ray.kill(p)
    wait_until(lambda: _gone(p, pid), 30, lambda: "the producer is dead")
    for call in (c.fetch_total.remote([refs[0]]), c.total.remote(refs[1])):
        with pytest.raises(rdt.PeerDiedError) as info:
            ray.get(call, timeout=60)
        shown = str(info.value)
        assert "During handling of the above exception" not in shown, shown
        assert shown.count("The above exception was the direct cause") <= 1, shown
        assert "_Stale" not in shown, shown
        assert "rdt_async.PeerDiedError: tcp fetch of" in shown or "PeerDiedError" in shown


def test_one_chain_keeps_the_native_cause_below_our_error():
    from rdt_async._errors import one_chain

    try:
        try:
            try:
                raise ConnectionResetError("reset")
            except ConnectionResetError:
                raise ConnectionRefusedError("refused")  # noqa: B904  (as a retry meets it)
        except ConnectionRefusedError as native:
            try:
                raise rdt.BackendError("tcp fetch of x failed") from native
            except rdt.BackendError as inner:
                raise rdt.PeerDiedError("tcp fetch of x: the producer died (BackendError: ...)") from inner
    except rdt.PeerDiedError as exc:
        one_chain(exc)
        assert type(exc.__cause__) is ConnectionRefusedError and exc.__suppress_context__
        assert exc.__cause__.__suppress_context__  # its retry's reset is not shown
        import traceback

        shown = "".join(traceback.format_exception(exc))
        assert "ConnectionResetError" not in shown and "BackendError: tcp fetch" not in shown
        assert shown.count("The above exception was the direct cause") == 1


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(n for n, line in enumerate(f, 1) if line.rstrip() == text)


def test_the_producer_fetching_back_warns_at_the_users_line_from_tasks_and_arguments(async_tools):
    # Before: the warning pointed at asyncio/events.py (a task's fetch) or at Ray's worker (an
    # argument's), not at the user's code.
    p = async_tools  # the producer: it records its warnings; this driver is the other process
    ray.get(p.record.remote())
    try:
        for method, line in (("take", _line_of("    async def take(self, value) -> bool:  # its argument is fetched before it runs")),
                             ("fetch_all_back", _line_of("        values = await rdt.fetch_all(refs)"))):
            ref = p.make.remote()
            assert checksum(rdt.get(ref, timeout=60)) == 6.0  # another process fetches it
            assert ray.get(getattr(p, method).remote(ref if method == "take" else [ref]), timeout=60) is True
            caught = ray.get(p.caught_warnings.remote())
            assert len(caught) == 1, caught
            message, filename, lineno = caught[0]
            assert "fetched both by the process that produced it" in message
            assert (filename, lineno) == (__file__, line), (method, caught)
            ray.get(p.record.remote())
    finally:
        ray.get(p.record.remote(on=False))
