"""What `@rdt.remote` makes of a class, built without a cluster: the methods Ray finds on
it (read from the class, called with the actor, as Ray's workers do), what the actor's
own code finds (read from the instance), and what its creation runs.

Producing needs Ray (each object's anchor is a Ray object): `kept` stands in for it,
returning what a producer would keep. Calls at a real actor: test_ray_parity.
"""

from __future__ import annotations

import functools
import gc
import inspect
import weakref

import pytest
import torch

import rdt_async as rdt
from rdt_async import _actor, _produce


@pytest.fixture
def kept(monkeypatch):
    """Producing, stood in for: a producer's call returns ("kept", transport, value)."""
    values: list = []

    def produce(value, transport):
        values.append(value)
        return ("kept", transport, value)

    monkeypatch.setattr(_produce, "produce", produce)
    return values


def ray_calls(cls, name, *args):
    """Call `name` as Ray's worker does: the function its class has, with the actor."""
    w = _actor._wrap_class(cls)
    return getattr(w, name)(w.__new__(w), *args)


def test_decorators_above_rdt_method_run_on_every_call(kept):
    calls = []

    def logged(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            calls.append(fn.__name__)
            return fn(self, *args, **kwargs)

        return inner

    class Model:
        @torch.no_grad()
        @rdt.method(tensor_transport="shm")
        def weights(self):
            return {"grad": torch.is_grad_enabled()}

        @logged
        @rdt.method
        def logged_weights(self):
            return {"w": 1}

    # Before: the decorators above were dropped: the body saw grad enabled, the log stayed empty.
    assert ray_calls(Model, "weights") == ("kept", "shm", {"grad": False})
    assert ray_calls(Model, "logged_weights") == ("kept", "auto", {"w": 1})
    assert calls == ["logged_weights"]


def test_the_actor_s_own_calls_run_the_method_as_written(kept):
    class Base:
        @rdt.method
        def weights(self):
            return {"w": torch.ones(2)}

    class Trainer(Base):
        @rdt.method(tensor_transport="shm")
        def weights(self):
            d = super().weights()  # before: TypeError "... decorated with @ray.remote"
            d["extra"] = Base.weights(self)["w"] + 1
            return d

        @rdt.method(tensor_transport="shm")
        async def aweights(self):
            return {"a": torch.zeros(1)}

        def step(self):
            return self.weights()  # before: the kept stand-in, and one more object kept each call

        async def astep(self):
            return await self.aweights()

    w = _actor._wrap_class(Trainer)
    t = w.__new__(w)
    own = t.step()
    assert sorted(own) == ["extra", "w"] and own["extra"].tolist() == [2.0, 2.0]
    import asyncio

    assert asyncio.run(t.astep())["a"].tolist() == [0.0]
    assert kept == []  # the actor's own calls keep nothing
    value = w.weights(t)  # what Ray runs for a call through a handle
    assert value[:2] == ("kept", "shm") and sorted(value[2]) == ["extra", "w"]
    assert len(kept) == 1


def test_each_name_is_what_python_finds_first_in_the_class_s_mro():
    class Base:
        def act(self, mode="base"):
            return f"act({mode})"

        def fast(self):
            return "Base.fast"

        def config(self):
            return "Base.config"

        def static(self):
            return "Base.static"

        def gone(self):
            return "Base.gone"

    class Child(Base):
        fast = functools.partialmethod(Base.act, "fast")
        static = staticmethod(lambda: "Child.static")
        gone = None

        @functools.cache  # noqa: B019 (the class lives for the test)
        def config(self):
            return "Child.config"

    w = _actor._wrap_class(Child)
    c = w.__new__(w)
    # Before: the base's function came back for each of them.
    assert (c.fast(), c.config(), w.static(), w.gone) == ("act(fast)", "Child.config", "Child.static", None)


def test_a_class_with_a_c_level_init_is_made_with_it():
    class Table(dict):
        def keys_(self):
            return sorted(self)

    w = _actor._wrap_class(Table)
    try:
        t = w({"a": 1}, b=2)  # before: TypeError from object.__init__
    finally:
        gc.unfreeze()
    assert t == {"a": 1, "b": 2} and t.keys_() == ["a", "b"]


class _Cycle:
    def __init__(self) -> None:
        self.me = self
        self.buf = torch.empty(1000)


def test_what_init_makes_is_not_frozen_out_of_collections(monkeypatch):
    """The freeze keeps a full collection from walking torch's and Ray's objects; what the
    actor's own __init__ makes (a module hooking its own method: a cycle) is collected when
    let go of."""

    class Holder:
        def __init__(self) -> None:
            self.cache = _Cycle()

        def reload(self) -> None:
            self.cache = _Cycle()

    monkeypatch.setenv("RDT_GC_FREEZE", "1")
    monkeypatch.setattr(_actor, "_frozen_in", None)  # (a fresh actor process)
    w = _actor._wrap_class(Holder)
    try:
        h = w()
        assert gc.get_freeze_count() > 0
        old = weakref.ref(h.cache.buf)
        h.reload()
        gc.collect()
        assert old() is None  # before: frozen with the cycle, never collected
        # The reset idiom: the actor's own `self.__init__()` froze what the first made.
        old = weakref.ref(h.cache.buf)
        h.__init__()
        gc.collect()
        assert old() is None
    finally:
        gc.unfreeze()


class _StaticAsync:
    def weights(self):
        return {}

    @staticmethod
    async def helper():
        return 1


class _AsyncContext:
    def weights(self):
        return {}

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass


@pytest.mark.parametrize("cls", [_StaticAsync, _AsyncContext])
def test_an_actor_is_async_as_ray_decides_it(cls):
    from ray._private.async_compat import has_async_methods

    w = _actor._wrap_class(cls)
    assert has_async_methods(w)  # Ray runs it as an asyncio actor
    # ...and so its control methods are coroutines, and it has the publishing group (before: sync).
    assert inspect.iscoroutinefunction(w.rdt__send) and hasattr(w, "rdt__publication")
    assert "rdt_publish" in rdt.remote(cls).__ray_metadata__.concurrency_groups


def test_the_wrapped_class_pickles_as_ray_sends_it_to_the_actor(kept):
    """By value, as cloudpickle takes a class of a test or a notebook: every wrapper with it."""
    from ray import cloudpickle

    class Model:
        @torch.no_grad()
        @rdt.method(tensor_transport="shm")
        def weights(self):
            return {"grad": torch.is_grad_enabled()}

        def own(self):
            return self.weights()

        def gen(self):
            yield self.weights()

    w = cloudpickle.loads(cloudpickle.dumps(_actor._wrap_class(Model)))
    m = w.__new__(w)
    assert w.weights(m) == ("kept", "shm", {"grad": False})
    assert w.own(m) == {"grad": False} and list(w.gen(m)) == [{"grad": False}]


class _Generators:
    def echo(self):
        got = yield "first"
        try:
            yield ("sent", got)
        except KeyError as e:
            yield ("thrown", str(e))
        return "ret"

    def drive(self):
        g = self.echo()
        out = [next(g), g.send(42), g.throw(KeyError("k"))]
        try:
            next(g)
        except StopIteration as stop:
            out.append(stop.value)
        return out

    async def aecho(self):
        got = yield "first"
        try:
            yield ("sent", got)
        except KeyError as e:
            yield ("thrown", str(e))

    async def adrive(self):
        g = self.aecho()
        return [await g.__anext__(), await g.asend(42), await g.athrow(KeyError("k"))]


def test_a_generator_method_the_actor_drives_itself_gets_what_it_is_sent_and_thrown():
    """The wrapper stepped the user's generator with next() alone: send() values came in as
    None, a throw() never reached it, and `yield from`'s return value was lost."""
    import asyncio

    h = _actor._wrap_class(_Generators)()
    assert h.drive() == ["first", ("sent", 42), ("thrown", "'k'"), "ret"]
    assert asyncio.run(h.adrive()) == ["first", ("sent", 42), ("thrown", "'k'")]
