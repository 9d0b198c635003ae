"""Collectives over RDT objects: allreduce and friends from driver code, on Gloo groups of real actors."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch
from conftest import wait_until

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")


def grads(rank: int, n: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    """A nested value: two dtypes besides float32, and a non-tensor leaf that differs per holder."""
    return {
        "w": (torch.arange(n, dtype=dtype) + rank).reshape(n // 2, 2),
        "b": [torch.full((n,), 2.0**rank, dtype=torch.float64), torch.arange(n) * (rank + 1)],
        "rank": rank,
    }


class Member:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def broken(self, name: str):
        from rdt_async.transports.gloo import groups

        g = groups.get(name)
        return None if g is None else g.broken

    def stats(self):
        return rdt.store_stats()

    def free(self, refs) -> None:
        rdt.free(refs[0])


@rdt.remote
class SyncWorker(Member):
    @rdt.method(tensor_transport="gloo")
    def grads(self, n: int = 6, dtype: torch.dtype = torch.float32):
        return grads(self.rank, n, dtype)

    @rdt.method(tensor_transport="gloo")
    def value(self, v):
        return v

    @rdt.method(tensor_transport="gloo")
    def full(self, n: int, fill: float):
        return torch.full((n,), fill)

    @rdt.method  # a worker in no group can still make objects (gloo ones it cannot)
    def grads_auto(self, n: int = 6):
        return grads(self.rank, n)

    def ping(self) -> str:
        return "pong"

    def reduce_here(self, refs):
        """A sync member reducing from inside a user method (blocking form)."""
        return [checksums(rdt.get(r, timeout=60)) for r in rdt.allreduce(refs)]


@rdt.remote
class AsyncWorker(Member):
    @rdt.method(tensor_transport="gloo")
    async def grads(self, n: int = 6, dtype: torch.dtype = torch.float32):
        return grads(self.rank, n, dtype)

    @rdt.method(tensor_transport="gloo")
    async def value(self, v):
        return v

    @rdt.method(tensor_transport="gloo")
    async def full(self, n: int, fill: float):
        return torch.full((n,), fill)

    @rdt.method
    async def grads_auto(self, n: int = 6):
        return grads(self.rank, n)

    async def ping(self) -> str:
        return "pong"


@rdt.remote
class Driver:
    """Not in any group: issues collectives from an async actor and fetches the results, and
    makes objects (an outsider's, for the groups' errors)."""

    @rdt.method  # an actor in no group can still make objects (gloo ones it cannot)
    async def grads_auto(self, n: int = 6):
        return grads(9, n)

    async def reduce(self, refs, op: str):
        out = await rdt.allreduce_async(refs, op=op)
        return [checksums(v) for v in await rdt.fetch_all(out)]

    async def gather_and_broadcast(self, refs, actors):
        gathered = await rdt.fetch((await rdt.allgather_async(refs))[0])
        copies = await rdt.fetch_all(await rdt.broadcast_async(refs[1], to=actors))
        return [v["rank"] for v in gathered], [v["rank"] for v in copies]


def checksums(value) -> list[float]:
    return [float(value["w"].double().sum()), float(value["b"][0].sum()), float(value["b"][1].double().sum())]


def short(actor) -> str:
    return actor._actor_id.hex()[:8]


@pytest.fixture(scope="module")
def four(cluster):
    """Four members, sync and async alternating; rank i is workers[i]."""
    workers = [SyncWorker.remote(0), AsyncWorker.remote(1), SyncWorker.remote(2), AsyncWorker.remote(3)]
    group = rdt.create_collective_group(workers, name="coll-four")
    yield workers, group
    rdt.destroy_collective_group(group)
    for w in workers:
        ray.kill(w)


@pytest.fixture(scope="module")
def driver(cluster):
    """An async actor in no group (shared by the tests: it keeps nothing between calls)."""
    d = Driver.remote()
    yield d
    ray.kill(d)


def expected(ranks, op: str, n: int = 6) -> dict:
    values = [grads(r, n) for r in ranks]
    def red(ts):
        s = torch.stack(ts)
        return {"sum": s.sum(0), "prod": s.prod(0), "min": s.min(0).values, "max": s.max(0).values,
                "avg": s.mean(0) if s.is_floating_point() else None}[op]  # fmt: skip

    return {"w": red([v["w"] for v in values]), "b": [red([v["b"][i] for v in values]) for i in (0, 1)]}


def assert_value(got, want, rank) -> None:
    assert got["rank"] == rank  # each result keeps its holder's non-tensor leaves
    assert torch.equal(got["w"], want["w"]) and got["w"].dtype == want["w"].dtype
    for g, w in zip(got["b"], want["b"]):
        assert torch.allclose(g, w) and g.dtype == w.dtype and g.shape == w.shape


def test_allreduce_from_the_driver_returns_one_ref_per_holder_and_leaves_inputs_untouched(four, driver):
    workers, _ = four
    refs = [w.grads.remote() for w in workers]
    out = rdt.allreduce(refs)
    assert len(out) == 4 and all(isinstance(r, ray.ObjectRef) for r in out)
    objs = ray.get(out)
    assert [o.producer.actor._actor_id for o in objs] == [w._actor_id for w in workers]  # held by each holder
    want = expected(range(4), "sum")
    for rank, r in enumerate(out):
        assert_value(rdt.get(r, timeout=60), want, rank)
    for rank, r in enumerate(refs):
        assert_value(rdt.get(r, timeout=60), {"w": grads(rank)["w"], "b": grads(rank)["b"]}, rank)
    # A member fetches a result held by another member over the group (the usual machinery).
    ranks = ray.get(driver.gather_and_broadcast.remote(refs, workers))
    assert ranks == ([0, 1, 2, 3], [1, 1, 1, 1])


@pytest.mark.parametrize("op", ["prod", "min", "max"])
def test_every_reduction_op_on_nested_values(four, op):
    workers, _ = four
    out = rdt.allreduce([w.grads.remote() for w in workers], op=op)
    want = expected(range(4), op)
    assert_value(rdt.get(out[3], timeout=60), want, 3)


def test_avg_on_floats_and_refused_on_integers_before_communicating(four):
    workers, _ = four
    out = rdt.allreduce([w.value.remote(torch.tensor([1.0, 2.0]) * (i + 1)) for i, w in enumerate(workers)], op="avg")
    assert rdt.get(out[0], timeout=60).tolist() == [2.5, 5.0]
    ints = [w.value.remote(torch.tensor([1, 2]) * (i + 1)) for i, w in enumerate(workers)]
    with pytest.raises(ValueError, match=r"op='avg'.*tensor 0 is int64\[2\]@cpu.*use op='sum' and divide"):
        rdt.allreduce(ints, op="avg")
    total = rdt.get(rdt.allreduce(ints)[0], timeout=60)  # the documented fix: sum, then divide
    assert (total // 4).tolist() == [2, 5]


def test_allgather_in_refs_order_and_reduce_scatter_by_position(four):
    workers, _ = four
    refs = [w.grads.remote(8) for w in workers]
    order = [2, 0, 3, 1]
    gathered = rdt.get(rdt.allgather([refs[i] for i in order])[1], timeout=60)
    assert [v["rank"] for v in gathered] == order
    assert all(torch.equal(v["b"][1], grads(r, 8)["b"][1]) for v, r in zip(gathered, order))
    out = rdt.reduce_scatter([refs[i] for i in order], op="max")
    whole = expected(range(4), "max", 8)
    for pos, r in enumerate(out):
        got = rdt.get(r, timeout=60)
        assert got["rank"] == order[pos] and got["w"].shape == (1, 2)
        assert torch.equal(got["w"], whole["w"].chunk(4)[pos])
        assert all(torch.equal(got["b"][i], whole["b"][i].chunk(4)[pos]) for i in (0, 1))
    with pytest.raises(ValueError, match=r"tensor 0 is float32\[3, 2\]@cpu; its dim 0 must split evenly into 4"):
        rdt.reduce_scatter([w.grads.remote() for w in workers])


def test_broadcast_to_actors_returns_one_ref_per_receiver(four):
    workers, _ = four
    src = workers[2].grads.remote()
    out = rdt.broadcast(src, to=[workers[3], workers[0], workers[1], workers[2]])
    assert [ray.get(r).producer.actor._actor_id for r in out] == [workers[i]._actor_id for i in (3, 0, 1, 2)]
    for r in out:
        assert_value(rdt.get(r, timeout=60), {"w": grads(2)["w"], "b": grads(2)["b"]}, 2)
    # Group members outside to= take part without keeping anything, given the group.
    g = rdt.create_collective_group(workers[:3], name="coll-three")
    try:
        out = rdt.broadcast(workers[0].value.remote(torch.ones(3)), to=[workers[1]], group=g)
        assert len(out) == 1 and rdt.get(out[0], timeout=60).tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(rdt.CollectiveGroupError, match=rf"rank 2 \(actor {short(workers[2])}\) must take part"):
            rdt.broadcast(workers[0].value.remote(torch.ones(3)), to=[workers[1]], group="coll-three")
    finally:
        rdt.destroy_collective_group(g)


def test_inplace_reduces_into_the_inputs(four):
    workers, _ = four
    refs = [w.grads.remote() for w in workers]
    out = rdt.allreduce(refs, inplace=True)
    want = expected(range(4), "sum")
    assert_value(rdt.get(refs[1], timeout=60), want, 1)  # the input itself now holds the sum
    assert_value(rdt.get(out[1], timeout=60), want, 1)


def test_results_never_share_a_buffer_with_a_live_result(four):
    workers, _ = four
    first = rdt.allreduce([w.value.remote(torch.full((1 << 16,), 1.0)) for w in workers])
    second = rdt.allreduce([w.value.remote(torch.full((1 << 16,), 2.0)) for w in workers])
    assert float(rdt.get(first[0], timeout=60).sum()) == 4.0 * (1 << 16)
    assert float(rdt.get(second[0], timeout=60).sum()) == 8.0 * (1 << 16)


async def test_async_form_from_the_driver_and_concurrent_collectives_on_two_groups(four):
    workers, _ = four
    with pytest.raises(RuntimeError, match=r"await rdt.allreduce_async\(\)"):
        rdt.allreduce([w.grads.remote() for w in workers])
    pair = await rdt.create_collective_group_async(workers[1:3], name="coll-pair")  # overlaps the four
    try:
        for _ in range(3):
            four_refs = [w.grads.remote() for w in workers]
            pair_refs = [w.grads.remote() for w in workers[1:3]]  # in both groups: the pair is picked
            a, b = await asyncio.gather(rdt.allreduce_async(four_refs), rdt.allreduce_async(pair_refs, op="max"))
            got_a, got_b = await rdt.fetch_all([a[0], b[1]])
            assert_value(got_a, expected(range(4), "sum"), 0)
            assert_value(got_b, expected([1, 2], "max"), 2)
    finally:
        await rdt.destroy_collective_group_async(pair)


def test_from_inside_actors_sync_member_and_async_outsider(four, driver):
    workers, _ = four
    want = checksums(expected(range(4), "sum") | {"rank": 0})
    refs = [w.grads.remote() for w in workers]
    assert ray.get(workers[0].reduce_here.remote(refs), timeout=60) == [want] * 4
    assert ray.get(driver.reduce.remote(refs, "sum"), timeout=60) == [want] * 4


def test_errors_name_the_holder_and_leave_the_group_usable(four, driver):
    workers, _ = four
    outsider = driver  # in no group
    refs = [w.grads.remote() for w in workers]
    with pytest.raises(rdt.CollectiveGroupError, match=rf"ref 3 is held by actor {short(outsider)}, which shares no"):
        rdt.allreduce([*refs[:3], outsider.grads_auto.remote()])
    with pytest.raises(rdt.CollectiveGroupError, match=rf"ref 3 is held by actor {short(outsider)}, which is not in"):
        rdt.allreduce([*refs[:3], outsider.grads_auto.remote()], group="coll-four")
    with pytest.raises(rdt.CollectiveGroupError, match=rf"refs\[0\] and refs\[2\] are both held by actor {short(workers[0])}"):
        rdt.allreduce([refs[0], refs[1], workers[0].grads.remote(), refs[3]])
    with pytest.raises(rdt.CollectiveGroupError, match=rf"refs\[1\] and refs\[2\] are both held by actor {short(workers[1])}"):
        rdt.allreduce([refs[0], refs[1], refs[1], refs[3]])
    with pytest.raises(ValueError, match=rf"tensor 0 of ref 2 \(held by actor {short(workers[2])}\) is float32\[4, 2\]@cpu but ref 0's is float32\[3, 2\]"):
        rdt.allreduce([refs[0], refs[1], workers[2].grads.remote(8), refs[3]])
    with pytest.raises(ValueError, match=rf"tensor 0 of ref 1 \(held by actor {short(workers[1])}\) is float64\[3, 2\]@cpu"):
        rdt.allgather([refs[0], workers[1].grads.remote(6, torch.float64), refs[2], refs[3]])
    with pytest.raises(rdt.CollectiveGroupError, match=rf"rank 3 \(actor {short(workers[3])}\) holds none"):
        rdt.allreduce(refs[:3])
    with pytest.raises(rdt.CollectiveGroupError, match=r"ref 1 is held by driver/process .* in no collective group"):
        rdt.allreduce([refs[0], rdt.put(grads(1)), refs[2], refs[3]])
    with pytest.raises(rdt.CollectiveGroupError, match=rf"actor {short(outsider)} \(in to=\) is not in collective group"):
        rdt.broadcast(refs[0], to=[workers[1], outsider], group="coll-four")
    with pytest.raises(rdt.CollectiveGroupError, match=r"to\[0\] and to\[1\] are both actor"):
        rdt.broadcast(refs[0], to=[workers[1], workers[1]])
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        rdt.allreduce(refs, op="mean")
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'shmm'; available: auto, inline, shm"):
        rdt.allreduce(refs, tensor_transport="shmm", inplace=True)  # refused before anything is reduced
    with pytest.raises(ValueError, match=r"unknown tensor_transport 'shmm'"):
        rdt.broadcast(refs[0], to=[workers[1]], tensor_transport="shmm")
    # Refused before anything is sent, where members reduced the wrong pairs, or failed
    # inside the collective (which broke the group), or wrote into a copy:
    ones, zeros = torch.ones(4), torch.zeros(4)
    orders = [m.value.remote({"w": ones, "b": zeros} if i % 2 else {"b": zeros, "w": ones}) for i, m in enumerate(workers)]
    with pytest.raises(ValueError, match=r"ref 1 \(held by actor .*\) names its tensors \['w'\], \['b'\], ref 0 \['b'\], \['w'\]: tensors are reduced by their place"):
        rdt.allreduce(orders)
    shorts = [m.value.remote(torch.zeros(4, dtype=torch.int16)) for m in workers]
    with pytest.raises(ValueError, match=r"tensor 0 is int16\[4\]@cpu, and Gloo reduces no int16 tensors"):
        rdt.allreduce(shorts)
    complexes = [m.value.remote(torch.zeros(4, dtype=torch.complex64)) for m in workers]
    with pytest.raises(ValueError, match=r"allreduce\(op='max'\): tensor 0 is complex64\[4\]@cpu, and Gloo has no max"):
        rdt.allreduce(complexes, op="max")
    assert rdt.get(rdt.allreduce(complexes)[0], timeout=60).tolist() == [0j] * 4
    snapshots = [m.grads_auto.remote() for m in workers]  # auto: inline, a copy taken at return
    with pytest.raises(ValueError, match=r"allreduce\(inplace=True\): ref 0 \(held by actor .*\) was returned over 'auto'.*tensor_transport='gloo'"):
        rdt.allreduce(snapshots, inplace=True)
    with pytest.raises(ValueError, match=r"rdt.allreduce needs one ref from each member; it got none"):
        rdt.allreduce([])
    assert all(b is None for b in ray.get([w.broken.remote("coll-four") for w in workers]))
    assert_value(rdt.get(rdt.allreduce(refs)[2], timeout=60), expected(range(4), "sum"), 2)


def test_an_input_freed_by_another_process_fails_cleanly_and_keeps_the_group(four):
    workers, _ = four
    refs = [w.grads.remote() for w in workers]
    ray.get(workers[0].free.remote([refs[2]]))  # the caller cannot know: rank 2 takes part with zeros
    obj_id = ray.get(refs[2]).obj_id
    wait_until(lambda: ray.get(workers[2].__ray_call__.remote(_freed, obj_id)), 30, lambda: "rank 2 has freed it")
    with pytest.raises(rdt.ObjectFreedError, match=r"rank 2 .* was freed before the collective"):
        rdt.allreduce(refs)
    assert all(b is None for b in ray.get([w.broken.remote("coll-four") for w in workers]))
    refs[2] = workers[2].grads.remote()
    assert_value(rdt.get(rdt.allreduce(refs)[0], timeout=60), expected(range(4), "sum"), 0)


def _freed(self, obj_id: str) -> bool:
    from rdt_async._store import store

    return store.get(obj_id) is None


def test_a_member_killed_mid_collective_gives_peer_died_and_breaks_the_group_in_survivors(four):
    workers, _ = four
    victim = SyncWorker.remote(2)
    members = [workers[0], workers[1], victim]  # survivors of a sync and an async kind
    g = rdt.create_collective_group(members, name="coll-doomed")
    refs = [m.full.remote(64 << 20, 1.0) for m in members]  # 256 MiB each: ~0.5 s here, killed well within
    ray.wait(refs, num_returns=3)

    async def run():
        task = asyncio.ensure_future(rdt.allreduce_async(refs))
        await asyncio.sleep(0.15)
        ray.kill(victim)
        return await task

    t0 = time.monotonic()
    with pytest.raises(rdt.PeerDiedError, match=rf"rank 2 \(actor {short(victim)}\) died"):
        asyncio.run(run())
    assert time.monotonic() - t0 < 20
    survivors = members[:2]
    assert all("rdt.allreduce failed" in (b or "") for b in ray.get([m.broken.remote("coll-doomed") for m in survivors]))
    assert ray.get([m.ping.remote() for m in survivors]) == ["pong", "pong"]  # they serve calls
    rdt.destroy_collective_group(g)
    # Their other group is untouched, and the name can be used again.
    assert_value(rdt.get(rdt.allreduce([w.grads.remote() for w in workers])[1], timeout=60), expected(range(4), "sum"), 1)
    g2 = rdt.create_collective_group(survivors, name="coll-doomed")
    try:
        out = rdt.allreduce([m.full.remote(4, 1.0) for m in survivors])
        assert rdt.get(out[1], timeout=60).tolist() == [2.0] * 4
    finally:
        rdt.destroy_collective_group(g2)


def test_allgather_and_broadcast_move_dtypes_gloo_does_not(four):
    # They only move bytes: Gloo refused int16, unsigned, float8 and complex tensors inside
    # the collective ("Invalid scalar type"), which broke the group in every member.
    workers, group = four
    values = [torch.arange(4, dtype=torch.int16) + 10 * i for i in range(4)]
    refs = [w.value.remote({"s": v, "c": v.to(torch.complex64) * 1j}) for w, v in zip(workers, values)]
    gathered = rdt.get(rdt.allgather(refs)[2], timeout=60)
    assert [g["s"].tolist() for g in gathered] == [v.tolist() for v in values]
    assert all(torch.equal(g["c"], v.to(torch.complex64) * 1j) for g, v in zip(gathered, values))
    got = rdt.get(rdt.broadcast(refs[1], to=[workers[3]], group=group)[0], timeout=60)
    assert got["s"].dtype == torch.int16 and got["s"].tolist() == values[1].tolist()
    assert torch.equal(got["c"], values[1].to(torch.complex64) * 1j)
    assert all(b is None for b in ray.get([w.broken.remote("coll-four") for w in workers]))
