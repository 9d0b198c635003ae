"""Memory registered with NIXL ahead of time (Ray's register_nixl_memory), paid once.

A trainer registers its weights once and returns views of them every step; a consumer
registers the buffers it fetches into once. Neither calls NIXL's register_memory again,
counted by `rdt.store_stats()["registered"]["nixl"]`, and closing gives it all back.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("nixl")

import ray
import torch
from conftest import wait_until
from helpers import checksum

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS, COLS = 64, 4096  # 1 MiB of float32; a row (16 KiB) and a block of 16 rows (256 KiB)
BLOCK = 16
STEPS = 4
LINGER_S = 0.3  # past the producer's linger (50 ms plus the bytes at 1 GiB/s) after a free


def weights(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def registered() -> dict:
    return rdt.store_stats()["registered"].get("nixl", {})


def counts() -> tuple[int, int]:
    """This process's registered storages and registrations made (0 before its agent exists)."""
    now = registered()
    return now.get("storages", 0), now.get("registered_total", 0)


@rdt.remote
class Trainer:
    """A sync actor, as in Ray's example: its weights are registered in __init__."""

    def __init__(self) -> None:
        self.w = weights(1)
        self.plain = weights(2)  # never registered: what every step costs without it
        self.reg = rdt.register_memory_sync(self.w)

    @rdt.method(tensor_transport="nixl")
    def block(self, step: int):
        """Views of the registered weights: a block of rows, and one row."""
        i = step % (ROWS // BLOCK)
        return {"block": self.w[i * BLOCK : (i + 1) * BLOCK], "row": self.w[step], "step": step}

    @rdt.method(tensor_transport="nixl")
    def plain_block(self, step: int):
        i = step % (ROWS // BLOCK)
        return {"block": self.plain[i * BLOCK : (i + 1) * BLOCK], "row": self.plain[step], "step": step}

    def state(self) -> dict:
        return {"objects": rdt.store_stats()["objects"], **registered(), "repr": repr(self.reg)}

    def close(self) -> str:
        self.reg.close()
        return repr(self.reg)

    def close_again(self) -> str:
        try:
            self.reg.close()
        except RuntimeError as exc:
            return str(exc)
        return "closed twice without a word"

    def register_again(self) -> str:
        self.reg = rdt.register_memory_sync(self.w)
        return repr(self.reg)


@rdt.remote
class Learner:
    """An async consumer that fetches into buffers it registered once."""

    def __init__(self) -> None:
        self.buf = torch.zeros(BLOCK, COLS)
        self.row = torch.zeros(COLS)
        self.plain = torch.zeros(BLOCK, COLS)
        self.reg: rdt.MemoryRegistration | None = None

    async def register(self) -> str:
        self.reg = await rdt.register_memory([self.buf, self.row])
        return repr(self.reg)

    async def close(self) -> None:
        assert self.reg is not None
        self.reg.close()

    async def fetch_into(self, refs: list, registered_buffers: bool) -> tuple[bool, list[float]]:
        """Fetch into the registered buffers (or plain ones); return if it landed there, and digests."""
        buf = self.buf if registered_buffers else self.plain
        value = await rdt.fetch(refs[0], into={"block": buf, "row": self.row, "step": None})
        landed = value["block"].data_ptr() == buf.data_ptr() and value["row"].data_ptr() == self.row.data_ptr()
        return landed, [checksum(buf), checksum(self.row), float(value["step"])]

    async def state(self) -> dict:
        return registered()


@pytest.fixture(scope="module")
def trainer():
    t = Trainer.remote()
    yield t
    ray.kill(t)


@pytest.fixture(scope="module")
def learner():
    c = Learner.remote()
    yield c
    ray.kill(c)


def want(seed: int, step: int) -> list[float]:
    w = weights(seed)
    i = step % (ROWS // BLOCK)
    return [checksum(w[i * BLOCK : (i + 1) * BLOCK]), checksum(w[step]), float(step)]


def settled(actor) -> dict:
    """The actor's state once its freed objects are gone and their linger has passed."""
    wait_until(lambda: ray.get(actor.state.remote()).get("objects", 0) == 0, 30)
    time.sleep(LINGER_S)
    return ray.get(actor.state.remote())


def test_a_producer_registers_its_weights_once_for_every_step(trainer, learner):
    start = settled(trainer)
    assert start["held_storages"] == 1 and start["held_bytes"] == ROWS * COLS * 4, start
    for step in range(STEPS):  # each step's object is freed before the next: nothing else holds the storage
        ref = trainer.block.remote(step)
        assert ray.get(learner.fetch_into.remote([ref], False)) == (True, want(1, step))
        del ref
        settled(trainer)
    after = settled(trainer)
    assert after["registered_total"] == start["registered_total"], (start, after)  # no registration per step
    assert after["storages"] == start["storages"] and after["held_storages"] == 1
    # The same steps from weights that were not registered: one registration each.
    for step in range(STEPS):
        ref = trainer.plain_block.remote(step)
        assert ray.get(learner.fetch_into.remote([ref], False)) == (True, want(2, step))
        del ref
        settled(trainer)
    plain = settled(trainer)
    assert plain["registered_total"] == after["registered_total"] + STEPS
    assert plain["deregistered_total"] == after["deregistered_total"] + STEPS
    assert plain["storages"] == after["storages"]


def test_a_consumer_registers_its_buffers_once_for_every_fetch(trainer, learner):
    assert ray.get(learner.register.remote()) == (
        f"<MemoryRegistration nixl: 2 tensor(s), {(BLOCK + 1) * COLS * 4} bytes, registered>"
    )
    start = ray.get(learner.state.remote())
    assert start["held_storages"] == 2 and start["storages"] == 2, start
    for step in range(STEPS):
        ref = trainer.block.remote(step)
        assert ray.get(learner.fetch_into.remote([ref], True)) == (True, want(1, step))
        del ref
    again = ray.get(learner.state.remote())
    assert again["registered_total"] == start["registered_total"], (start, again)  # none per fetch
    assert again["storages"] == 2
    # Into a buffer nobody registered: one registration per fetch, dropped after it.
    for step in range(STEPS):
        ref = trainer.block.remote(step)
        assert ray.get(learner.fetch_into.remote([ref], False)) == (True, want(1, step))
        del ref
    wait_until(lambda: ray.get(learner.state.remote())["storages"] == 2, 10)
    plain = ray.get(learner.state.remote())
    assert plain["registered_total"] == again["registered_total"] + STEPS
    ray.get(learner.close.remote())
    wait_until(lambda: ray.get(learner.state.remote())["storages"] == 0, 10)
    done = ray.get(learner.state.remote())
    assert done["bytes"] == 0 and done["held_storages"] == 0
    assert done["registered_total"] == done["deregistered_total"]  # nothing left registered


def test_closing_while_an_object_uses_the_memory_keeps_it_until_the_object_goes(trainer, learner):
    ref = trainer.block.remote(5)
    ray.wait([ref])
    before = ray.get(trainer.state.remote())
    assert ray.get(trainer.close.remote()) == f"<MemoryRegistration nixl: 1 tensor(s), {ROWS * COLS * 4} bytes, closed>"
    held = ray.get(trainer.state.remote())
    # The object still reads registered memory: the storage stays registered, no longer held.
    assert held["storages"] == before["storages"] and held["held_storages"] == 0
    assert held["deregistered_total"] == before["deregistered_total"]
    time.sleep(LINGER_S)
    assert ray.get(learner.fetch_into.remote([ref], False)) == (True, want(1, 5))
    del ref
    gone = settled(trainer)
    assert gone["storages"] == before["storages"] - 1 and gone["bytes"] == before["bytes"] - ROWS * COLS * 4
    assert gone["deregistered_total"] == before["deregistered_total"] + 1
    assert gone["registered_total"] == gone["deregistered_total"]  # the producer holds nothing registered
    assert ray.get(trainer.close_again.remote()) == (
        "this registration of 1 tensor(s) with 'nixl' is closed already: close each registration once "
        "(a `with` or `async with` block closes it at its end)"
    )
    # Registered anew, it is paid once more, and steps reuse it again.
    assert ray.get(trainer.register_again.remote()).endswith("registered>")
    again = ray.get(trainer.state.remote())
    assert again["registered_total"] == gone["registered_total"] + 1 and again["held_storages"] == 1


def test_bad_input_names_the_fix_and_registers_nothing():
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)

    async def refused() -> list[tuple[str, str]]:
        out = []
        for bad, kw in [
            (w.t(), {}),
            (torch.zeros(4, device="meta"), {}),
            (w.to_sparse(), {}),
            ([w, 3], {}),
            ([], {}),
            (torch.empty(0), {}),
            (w, {"transport": "shm"}),
            (w, {"transport": "auto"}),
            (w, {"transport": "carrier-pigeon"}),
        ]:
            try:
                await rdt.register_memory(bad, **kw)
                out.append(("registered", ""))
            except (TypeError, ValueError) as exc:
                out.append((type(exc).__name__, str(exc)))
        return out

    before = counts()
    out = asyncio.run(refused())
    assert out[0] == (
        "ValueError",
        "rdt.register_memory(): tensor 0 is not contiguous (shape [8, 8], stride [1, 8]): an object made of it "
        "would be a contiguous copy, which the registration would not cover; register the contiguous tensor "
        "it is a view of (its whole storage is registered)",
    )
    assert out[1] == (
        "ValueError",
        "rdt.register_memory(): tensor 0 is on meta; transport 'nixl' registers memory on cpu, cuda: "
        "move it there first (t.to(...)) and register that tensor",
    )
    assert out[2] == ("ValueError", "rdt.register_memory(): tensor 0 is torch.sparse_coo, not dense; register t.to_dense()")
    assert out[3] == ("TypeError", "rdt.register_memory(): item 1 is not a tensor but int 3")
    assert out[4] == ("ValueError", "rdt.register_memory() got no tensors: pass the tensors whose memory to register")
    assert out[5] == ("ValueError", "rdt.register_memory(): no tensor with memory to register (all are empty)")
    assert out[6] == (
        "ValueError",
        "rdt.register_memory(transport='shm'): transport 'shm' registers no memory ahead of time (it has nothing "
        "per object that a registration would save); register with a transport that does, e.g. transport='nixl'",
    )
    assert out[7][0] == "ValueError" and "`auto` picks a transport per object" in out[7][1]
    assert out[8][0] == "ValueError" and out[8][1].startswith("unknown tensor_transport 'carrier-pigeon'")
    assert counts() == before  # nothing registered, nothing made
    with pytest.raises(RuntimeError, match=r"use `await rdt.register_memory\(...\)` here instead"):
        asyncio.run(_sync_on_a_loop(w))


async def _sync_on_a_loop(w: torch.Tensor) -> None:
    rdt.register_memory_sync(w)


def test_a_cancelled_registration_leaves_nothing_registered():
    big = torch.ones(16 << 20, dtype=torch.uint8)

    async def cancel_it() -> tuple[bool, dict]:
        task = asyncio.ensure_future(rdt.register_memory(big))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True, registered()
        task.result().close()  # it finished first: close it as the user would
        return False, registered()

    asyncio.run(_warm())  # the agent exists first
    before = registered()
    cancelled, after = asyncio.run(cancel_it())
    assert cancelled
    assert after["storages"] == before["storages"] and after["bytes"] == before["bytes"], (before, after)
    assert after["held_storages"] == before["held_storages"]
    assert after["registered_total"] - before["registered_total"] == after["deregistered_total"] - before["deregistered_total"]


async def _warm() -> None:
    async with await rdt.register_memory(torch.zeros(1)):
        pass


def test_thousands_of_storages_are_registered_and_let_go_in_one_call_each(monkeypatch):
    # NIXL's deregistration costs time in proportion to every region registered: 16,000
    # storages registered and let go one call each took seconds (a mixture-of-experts
    # state dict returned or fetched into over nixl). One call each way now; a storage still
    # used stays registered, the others go.
    from rdt_async.transports import _registry

    asyncio.run(_warm())  # the agent exists first
    here = _registry.transport("nixl")._current()
    calls = {"register_memory": 0, "deregister_memory": 0}
    for name in calls:
        real = getattr(here.agent.nixl, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(here.agent.nixl, name, counted)
    experts = [torch.full((64,), float(i)) for i in range(16_000)]
    before = registered()

    async def hold_then_close() -> tuple[dict, dict, dict]:
        many = await rdt.register_memory(experts)
        one = await rdt.register_memory(experts[7])  # (known: no call)
        held = registered()
        many.close()
        still = registered()  # experts[7] is used: it stays
        one.close()
        return held, still, registered()

    held, still, after = asyncio.run(hold_then_close())
    assert held["storages"] - before["storages"] == 16_000 and held["held_storages"] - before["held_storages"] == 16_000
    assert still["storages"] - before["storages"] == 1 and still["held_storages"] - before["held_storages"] == 1
    assert after["storages"] == before["storages"] and after["bytes"] == before["bytes"], (before, after)
    assert after["deregistered_total"] - before["deregistered_total"] == 16_000
    wait_until(lambda: calls["deregister_memory"] == 2, 10)  # (done at once where the agent is free, else soon)
    assert calls == {"register_memory": 1, "deregister_memory": 2}, calls  # 15,999 at the first close, 1 at the second


def _refusing(monkeypatch, times: int) -> dict[str, int]:
    """Make the real agent's NIXL refuse its next `times` registrations as NIXL does (its
    backend error), then register for real."""
    from nixl._api import nixlBind

    from rdt_async.transports import _registry

    asyncio.run(_warm())  # the agent exists first
    here = _registry.transport("nixl")._current()
    real = here.agent.nixl.register_memory
    calls = {"register_memory": 0}

    def refusing(*args):
        calls["register_memory"] += 1
        if calls["register_memory"] <= times:
            raise nixlBind.nixlBackendError("NIXL_ERR_BACKEND")
        return real(*args)

    monkeypatch.setattr(here.agent.nixl, "register_memory", refusing)
    return calls


def test_a_registration_nixl_refuses_once_is_made_by_a_second_call(monkeypatch, caplog):
    calls = _refusing(monkeypatch, 1)
    w = torch.arange(16.0)
    before = registered()

    async def hold() -> dict:
        async with await rdt.register_memory(w):
            return registered()

    with caplog.at_level("WARNING", logger="rdt_async"):
        held = asyncio.run(hold())
    assert held["storages"] - before["storages"] == 1 and held["bytes"] - before["bytes"] == w.nbytes
    assert calls["register_memory"] == 2
    assert "nixl refused to register 1 DRAM region(s) once" in caplog.text
    assert registered()["storages"] == before["storages"]


def test_a_registration_nixl_refuses_twice_fails_with_what_was_asked_and_how_to_learn_why(monkeypatch):
    calls = _refusing(monkeypatch, 2)
    w = torch.arange(16.0)
    before = registered()
    with pytest.raises(rdt.BackendError) as err:
        asyncio.run(rdt.register_memory(w))
    assert str(err.value).startswith(
        f"nixl could not register 1 DRAM region(s) of {w.nbytes} bytes, twice "
        "(nixlBackendError: NIXL_ERR_BACKEND; then nixlBackendError: NIXL_ERR_BACKEND): "
        "run with NIXL_LOG_LEVEL=DEBUG UCX_LOG_LEVEL=debug to see why"
    ), err.value
    assert calls["register_memory"] == 2
    after = registered()
    assert after["storages"] == before["storages"] and after["held_storages"] == before["held_storages"]


def test_two_storages_at_one_address_are_registered_as_two_regions():
    # `torch.from_numpy` of an array's first slice and of the array: two storages that start
    # at one address, of 64 bytes and 256 KiB. Keyed by address alone, the second took the
    # first's registration: its metadata declared 64 bytes, and every fetch of it failed as
    # an altered ref ("outside every region the producer registered").
    import numpy as np

    from rdt_async.transports import _registry
    from rdt_async.transports._base import TensorSpec, TransferInfo
    from rdt_async.transports.nixl._check import check

    array = np.arange(1 << 16, dtype=np.float32)
    small, big = torch.from_numpy(array[:16]), torch.from_numpy(array)
    assert small.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    nixl = _registry.transport("nixl")
    objs = {"ab" * 12: small, "cd" * 12: big}
    metas = {obj_id: nixl.prepare(obj_id, [t]) for obj_id, t in objs.items()}
    try:
        for obj_id, t in objs.items():
            meta = metas[obj_id]
            check(TransferInfo(obj_id, (TensorSpec.of(t),), meta, producer_pid=meta.pid), meta.pid)
    finally:
        for obj_id, meta in metas.items():
            nixl.garbage_collect(obj_id, meta)
