"""Gloo collective groups: receiver-driven transfers between members, failures, groups."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import time

import pytest
import ray
import torch
from conftest import ON_NODE2, wait_until
from helpers import checksum
from probes import cancel_after, kill_and_wait, listening

import rdt_async as rdt
from rdt_async.transports import _registry

# Which of the two the consumer sees first is a race: Gloo's closed connection (the producer
# disconnected) or Ray's verdict on the actor (it died). Both are PeerDiedError.
DIED = r"gloo fetch of \w+: the producer\b.*\b(died|disconnected)"

pytestmark = pytest.mark.usefixtures("ray_session")


@rdt.remote
class GlooProducer:
    @rdt.method(tensor_transport="gloo")
    def make(self, n: int, fill: float = 1.0):
        return {"w": torch.full((n,), fill), "b": [torch.arange(n % 97, dtype=torch.int64)], "tag": fill}

    @rdt.method
    def make_auto(self, n: int):
        return torch.full((n,), 3.0)

    @rdt.method(tensor_transport="gloo")
    def make_meta(self):
        return torch.empty(2, device="meta")

    @rdt.method(tensor_transport="gloo")
    def experts(self, n: int):
        """A state dict of many small tensors of every kind and a few large ones, each its own value."""
        g = torch.Generator().manual_seed(n)
        out = {}
        for i in range(n):
            dtype = (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float64)[i % 5]
            out[f"e{i}"] = torch.randint(0, 2 if dtype is torch.bool else 100, (i % 37 + 1,), generator=g).to(dtype)
        out["big"] = torch.arange(1 << 17, dtype=torch.float32)  # 512 KiB: alone
        out["scalar"] = torch.tensor(7.5)
        out["empty"] = torch.empty(0)
        return out

    def pid(self):
        import os

        return os.getpid()

    def die_after_first_tensor(self):
        """Fault injection: the next send delivers tensor 0 over Gloo, then this process dies."""
        import os

        from rdt_async.transports import gloo

        async def dying(transport, obj_id, tensors, meta, request):
            group, dst, base, _ = gloo.checked_request(request)
            await transport._send(group, dst, base, tensors[:1], gloo.HELD)
            os._exit(1)

        gloo.GlooTransport.send_multiple_tensors = dying


async def sums_and_transports(refs):
    """Checksums of the fetched values, and the transports this process used for them."""
    before = collections.Counter(rdt.store_stats()["fetches"])
    values = await rdt.fetch_all(refs)
    used = dict(collections.Counter(rdt.store_stats()["fetches"]) - before)
    return [checksum(v["w"]) if isinstance(v, dict) else checksum(v) for v in values], used


@rdt.remote
class AsyncMember:
    """An async member: fetches, and produces over gloo too (every member of a group can be
    both ends of some pair); outside any group, it passes refs between members."""

    @rdt.method(tensor_transport="gloo")
    async def make(self, n: int, fill: float):
        return {"w": torch.full((n,), fill)}

    async def relay(self, producer, consumer, n):
        return await consumer.take.remote(producer.make.remote(n, 5.0))

    async def sums(self, refs):
        return await sums_and_transports(refs)

    async def take(self, value):
        return checksum(value["w"]), value["tag"], value["b"][0].tolist()

    async def ping(self):
        return "pong"

    async def experts_into(self, refs):
        """Fetch the experts plain and into buffers of every kind; compare them byte for byte."""
        obj = await refs[0]
        plain = await rdt.fetch(obj)
        into = {}
        for k, t in plain.items():
            kind = int(k[1:]) % 3 if k[0] == "e" and k[1:].isdigit() else 0
            if kind == 0:
                into[k] = torch.zeros_like(t)
            elif kind == 1 and t.dim() == 1 and t.numel() > 1:
                into[k] = torch.zeros(2 * t.numel(), dtype=t.dtype)[::2]  # strided
            else:
                into[k] = torch.nn.Parameter(torch.zeros_like(t), requires_grad=False) if t.is_floating_point() else torch.zeros_like(t)
        await rdt.fetch(refs[0], into=into)
        same = all(torch.equal(into[k], t) for k, t in plain.items())
        dtypes = all(into[k].dtype == t.dtype and into[k].shape == t.shape for k, t in plain.items())
        return same, dtypes, float(plain["big"].sum()), plain["scalar"].item(), len(plain)

    async def cancel_into(self, refs, after: float):
        """Cancel a fetch into our buffers mid-transfer; report what they hold then and later."""
        obj = await refs[0]
        into = [torch.zeros(spec.shape, dtype=spec.dtype) for spec in obj.specs]
        first = await cancel_after(rdt.fetch(obj, into=into), after)
        then = checksum(into[0])
        await asyncio.sleep(0.5)
        return first, then, checksum(into[0])

    async def near_the_last_tag(self, group_name: str) -> int:
        from rdt_async.transports import gloo

        group = gloo.groups.get(group_name)
        group._next_tag = gloo.TAG_LIMIT - 3
        return group._next_tag


@rdt.remote
class SyncMember:
    def take(self, value):
        return checksum(value["w"])


@rdt.remote(max_concurrency=4)
class ThreadedMember:
    """A threaded (sync, max_concurrency=4) member: its calls run on several threads."""

    def take(self, value):
        return checksum(value["w"])

    def get_many(self, refs):
        return [checksum(rdt.get(r, timeout=60)["w"]) for r in refs]

    def fetches(self):
        return dict(rdt.store_stats()["fetches"])


@pytest.fixture(scope="module")
def members(cluster):
    """The module's group, made once: a sync producer, an async and a sync consumer, a
    threaded member. Tests that kill or break a group make their own actors for it."""
    p, c, s, t = GlooProducer.remote(), AsyncMember.remote(), SyncMember.remote(), ThreadedMember.remote()
    group = rdt.create_collective_group([p, c, s, t], backend="gloo")
    yield p, c, s, t, group
    rdt.destroy_collective_group(group)
    for a in (p, c, s, t):
        ray.kill(a)


@pytest.fixture
def pair(members):
    p, c, s, _, group = members
    yield p, c, s, group
    # every test leaves the shared group usable
    assert ray.get(c.sums.remote([p.make.remote(10, 1.0)]), timeout=60) == ([10.0], {"gloo": 1})


@pytest.fixture(scope="module")
def free_members(cluster):
    """Two async members in no group of the module's: each test puts them in its own groups
    (destroyed before it ends) or uses them as outsiders."""
    o1, o2 = AsyncMember.remote(), AsyncMember.remote()
    yield o1, o2
    for a in (o1, o2):
        ray.kill(a)


@pytest.fixture
def outsiders(free_members):
    yield free_members
    assert ray.get([o.ping.remote() for o in free_members]) == ["pong", "pong"]


def test_members_receive_over_gloo_sync_and_async(pair):
    p, c, s, _ = pair
    assert ray.get(c.take.remote(p.make.remote(1000, 2.0))) == (2000.0, 2.0, list(range(1000 % 97)))
    assert ray.get(s.take.remote(p.make.remote(1 << 16, 1.0))) == float(1 << 16)
    sums, used = ray.get(c.sums.remote([p.make.remote(10, 4.0)]))
    assert sums == [40.0] and used == {"gloo": 1}


def test_many_concurrent_transfers_between_one_pair(pair):
    p, c, _, _ = pair
    refs = [p.make.remote(1 << 18, float(i)) for i in range(16)]
    sums, used = ray.get(c.sums.remote(list(reversed(refs))))
    assert sums == [float(i * (1 << 18)) for i in reversed(range(16))]
    assert used == {"gloo": 16}


def test_outside_the_group_falls_back_to_the_object_store(pair, outsiders):
    p, _, _, _ = pair
    ref = p.make.remote(100, 7.0)
    before = collections.Counter(rdt.store_stats()["fetches"])
    assert checksum(rdt.get(ref, timeout=60)["w"]) == 700.0
    assert collections.Counter(rdt.store_stats()["fetches"]) - before == {"object_store": 1}
    outsider, _ = outsiders
    assert ray.get(outsider.sums.remote([ref])) == ([700.0], {"object_store": 1})


def test_refs_passed_by_an_actor_that_did_not_create_the_group(pair, outsiders):
    p, c, _, _ = pair
    o, _ = outsiders  # in no group: it submits the tasks that pass refs between members
    assert ray.get(o.relay.remote(p, c, 64)) == (320.0, 5.0, list(range(64)))


def test_concurrent_transfers_across_pairs_in_both_directions(pair, outsiders):
    # Every member produces over gloo and fetches: each is both ends of some pair. (c is
    # also in the module's group, which none of the others share with it.)
    _, c, _, _ = pair
    members = [c, *outsiders]
    g = rdt.create_collective_group(members)
    try:
        calls = []
        for i, consumer in enumerate(members):
            refs = [members[j].make.remote(1 << 18, float(10 * j + k)) for j in range(3) if j != i for k in range(4)]
            calls.append(consumer.sums.remote(refs))
        for i, (sums, used) in enumerate(ray.get(calls)):
            assert sums == [float((10 * j + k) * (1 << 18)) for j in range(3) if j != i for k in range(4)]
            assert used == {"gloo": 8}
    finally:
        rdt.destroy_collective_group(g)


def test_a_threaded_member_receives_on_several_threads_at_once(members):
    p, _, _, t, _ = members  # (t is used by this test only: its fetch counts are this test's)
    refs = [[p.make.remote(1 << 16, float(4 * b + i)) for i in range(4)] for b in range(4)]
    assert ray.get([t.get_many.remote(r) for r in refs]) == [
        [float(4 * b + i) * (1 << 16) for i in range(4)] for b in range(4)
    ]
    sums = ray.get([t.take.remote(p.make.remote(1000, float(i))) for i in range(8)])  # auto-fetched arguments
    assert sums == [1000.0 * i for i in range(8)]
    assert ray.get(t.fetches.remote()) == {"gloo": 24}


def test_an_actor_in_two_groups(pair, outsiders):
    # a is in the module's group too: three groups; b shares only g1 with it, c only g2.
    a, _, _, _ = pair
    b, c = outsiders
    g1 = rdt.create_collective_group([a, b])
    g2 = rdt.create_collective_group([c, a], name="second")
    try:
        assert ray.get(b.sums.remote([a.make.remote(8, 1.0)])) == ([8.0], {"gloo": 1})
        assert ray.get(c.sums.remote([a.make.remote(8, 2.0)])) == ([16.0], {"gloo": 1})
    finally:
        rdt.destroy_collective_group(g1)
        rdt.destroy_collective_group(g2)


def test_auto_weighs_a_shared_group_across_nodes(tmp_path, outsiders):
    # A group both ends are in is one of auto's candidates; it wins where the costs say so:
    # between these hosts tcp is faster, so gloo wins only for a member whose costs say it is.
    path = tmp_path / "gloo-costs.json"
    path.write_text(json.dumps({"cpu": {"gloo/hosts": [0.001, 50.0]}}))
    p = GlooProducer.options(**ON_NODE2).remote()
    plain, told = outsiders
    # (auto reads RDT_AUTO_COSTS at each choice: set in `told` for this test only)
    assert ray.get(told.__ray_call__.remote(_set_env, "RDT_AUTO_COSTS", str(path))) is None
    g = rdt.create_collective_group([p, plain, told])
    try:
        for member, want in ((plain, "tcp"), (told, "gloo")):
            sums, used = ray.get(member.sums.remote([p.make_auto.remote(1 << 16)]))  # 256 KiB
            assert sums == [3.0 * (1 << 16)]
            choice = ray.get(member.__ray_call__.remote(lambda self: rdt.store_stats()["auto"][-1]))
            assert "gloo" in choice["estimates_ms"], choice
            best = min(choice["estimates_ms"], key=choice["estimates_ms"].get)
            assert (best, choice["transport"], used) == (want, want, {want: 1}), choice["why"]
            assert choice["why"].startswith(f"256 KiB CPU from another node: {want} "), choice["why"]
    finally:
        rdt.destroy_collective_group(g)
        ray.get(told.__ray_call__.remote(_set_env, "RDT_AUTO_COSTS", None))
        ray.kill(p)


def _set_env(self, name: str, value: str | None) -> str | None:
    """Set (None: unset) an environment variable in the actor this runs in: what it was."""
    was = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    return was


def test_group_errors_say_why(outsiders):
    a, b = outsiders
    g = rdt.create_collective_group([a, b], name="taken")
    try:
        with pytest.raises(rdt.CollectiveGroupError, match="named 'taken' exists"):
            rdt.create_collective_group([a, b], name="taken")
    finally:
        rdt.destroy_collective_group(g)
    with pytest.raises(rdt.CollectiveGroupError, match="at least 1 actor, got none"):
        rdt.create_collective_group([])
    with pytest.raises(rdt.CollectiveGroupError, match="appears twice"):
        rdt.create_collective_group([a, a])
    with pytest.raises(rdt.CollectiveGroupError, match="unknown backend 'mpi'"):
        rdt.create_collective_group([a, b], backend="mpi")

    @ray.remote
    class Plain:
        pass

    plain = Plain.remote()
    try:
        with pytest.raises(rdt.CollectiveGroupError, match=re.escape("decorate its class with @rdt.remote")):
            rdt.create_collective_group([a, plain])
    finally:
        ray.kill(plain)
    dead = AsyncMember.remote()
    ray.get(dead.ping.remote())
    ray.kill(dead)
    with pytest.raises(rdt.CollectiveGroupError, match=r"member 1 .* is dead"):
        rdt.create_collective_group([a, dead])
    g = rdt.create_collective_group([a, b], name="taken")  # the name is free again
    rdt.destroy_collective_group(g)


def test_gloo_refuses_non_cpu_tensors_when_the_value_is_returned(pair):
    p, _, _, _ = pair  # in a group: the device is what is refused
    with pytest.raises(rdt.TransportUnavailableError, match="returned tensor 0 is on the meta device"):
        ray.get(p.make_meta.remote())
    # A device gloo does not handle (meta is the one this CPU machine can make): its own refusal.
    with pytest.raises(rdt.TransportUnavailableError, match="transport 'gloo' moves tensors on cpu, not meta"):
        _registry.transport("gloo").check_tensors([torch.empty(3, device="meta")])


@pytest.fixture(scope="module")
def survivors(free_members):
    """The consumers of the groups whose producer dies (not the module's: those groups
    break): an async one (a free member; each test destroys its broken group) and a sync one."""
    s = SyncMember.remote()
    yield free_members[0], s
    ray.kill(s)


def test_producer_killed_mid_transfer_breaks_the_group_not_the_survivors(survivors, members):
    c, s = survivors
    p = GlooProducer.remote()
    g = rdt.create_collective_group([p, c, s])
    ref = p.make.remote(1 << 20)
    ray.wait([ref])
    ray.kill(p)  # dies with the object unfetched: the consumer's receive is posted first
    t0 = time.monotonic()
    with pytest.raises(rdt.PeerDiedError, match=DIED):
        ray.get(c.sums.remote([ref]), timeout=60)
    assert time.monotonic() - t0 < 30
    # Later use says so; the object's producer is the one that died, so still a death (callers
    # branch on PeerDiedError to produce again elsewhere), naming the broken group.
    with pytest.raises(rdt.PeerDiedError, match=r"died or disconnected; its collective group '.*' is broken"):
        ray.get(c.sums.remote([ref]), timeout=60)
    assert ray.get(c.ping.remote()) == "pong"  # the survivor serves other calls
    rdt.destroy_collective_group(g)
    p2 = members[0]  # a live producer (the module's; it shares no other group with c, s)
    g2 = rdt.create_collective_group([p2, c, s])  # recreated on the survivors
    assert ray.get(c.sums.remote([p2.make.remote(10, 1.0)])) == ([10.0], {"gloo": 1})
    rdt.destroy_collective_group(g2)


def test_producer_dying_between_the_tensors_of_one_transfer(survivors):
    # Tensor 0 has arrived and tensor 1's receive is posted when the producer dies.
    c, s = survivors
    p = GlooProducer.remote()
    g = rdt.create_collective_group([p, c, s])
    ref = p.make.remote((1 << 22) + 5)  # 16 MiB "w", then a 5-element "b"
    ray.get(p.die_after_first_tensor.remote())
    t0 = time.monotonic()
    with pytest.raises(rdt.PeerDiedError, match=DIED):
        ray.get(c.sums.remote([ref]), timeout=60)
    assert time.monotonic() - t0 < 30
    with pytest.raises(rdt.PeerDiedError, match=r"died or disconnected; its collective group '.*' is broken"):
        ray.get(c.sums.remote([ref]), timeout=60)
    assert ray.get(c.ping.remote()) == "pong"
    assert ray.get(s.take.remote({"w": torch.ones(3)})) == 3.0  # the other member serves calls too
    rdt.destroy_collective_group(g)
    ray.kill(p)


def test_a_dead_producer_on_another_node_is_named_dead_over_a_group_another_member_broke(survivors):
    # The consumers learn of a death on their own node from its pid, and of one a fetch
    # found; a producer on another node that died while they fetched from someone else is
    # Ray's to tell: a fetch of its object over the group that death broke asks Ray.
    c, s = survivors
    far, near = GlooProducer.options(**ON_NODE2).remote(), GlooProducer.remote()
    g = rdt.create_collective_group([far, near, c, s])
    try:
        far_ref, near_ref = far.make.remote(1 << 16, 2.0), near.make.remote(1 << 16)
        ray.wait([far_ref, near_ref], num_returns=2)
        ray.kill(near)
        with pytest.raises(rdt.PeerDiedError, match=DIED):
            ray.get(c.sums.remote([near_ref]), timeout=60)
        # A live producer's object over the broken group: the group's state (the other
        # member's group is not broken: the failed transfer was not its own).
        with pytest.raises(rdt.CollectiveGroupError, match=r"collective group '.*' is broken"):
            ray.get(c.sums.remote([far_ref]), timeout=60)
        assert ray.get(s.take.remote(far_ref), timeout=60) == 2.0 * (1 << 16)
        kill_and_wait(far)
        # Dead now: a death, which callers branch on to produce again elsewhere.
        died = r"gloo fetch of \w+: the producer \(actor .*\) died \(CollectiveGroupError: .*is broken"
        with pytest.raises(rdt.PeerDiedError, match=died):
            ray.get(c.sums.remote([far_ref]), timeout=60)
        with pytest.raises(rdt.PeerDiedError, match=DIED):
            ray.get(s.take.remote(far_ref), timeout=60)
        assert ray.get(c.ping.remote()) == "pong"
    finally:
        rdt.destroy_collective_group(g)
        for a in (far, near):
            ray.kill(a)


def test_fetch_of_a_freed_gloo_object_fails_cleanly(pair):
    p, c, _, _ = pair
    ref = p.make.remote(1000)
    obj_id = ray.get(ref).obj_id
    rdt.free(ref)
    wait_until(lambda: ray.get(p.__ray_call__.remote(_freed, obj_id)), 30, lambda: "the producer has freed it")
    with pytest.raises(rdt.ObjectFreedError):
        ray.get(c.sums.remote([ref]))
    assert ray.get(c.sums.remote([p.make.remote(10, 1.0)])) == ([10.0], {"gloo": 1})  # group still fine


def _freed(self, obj_id: str) -> bool:
    from rdt_async._store import store

    return store.get(obj_id) is None


def test_cancelled_fetch_into_buffers_is_not_written_after_it_returns(pair):
    # Gloo cannot cancel a posted receive: the cancel returns once the bytes have landed.
    p, c, _, _ = pair
    n = 1 << 24  # 64 MiB: tens of ms on the wire, cancelled 5 ms in
    first, then, later = ray.get(c.cancel_into.remote([p.make.remote(n, 2.0)], 0.005))
    assert first in ("cancelled", "done")
    assert then == later == 2.0 * n
    assert ray.get(c.sums.remote([p.make.remote(10, 1.0)])) == ([10.0], {"gloo": 1})  # group still fine


def test_tags_wrap_before_they_leave_int32(pair):
    # A transfer reserves 1 + n tags (status, tensors); a group's tags wrap at TAG_LIMIT.
    p, c, _, group = pair
    from rdt_async.transports import gloo

    assert ray.get(c.near_the_last_tag.remote(group.name)) == gloo.TAG_LIMIT - 3
    refs = [p.make.remote(100 + i, float(i)) for i in range(4)]  # 3 tags each: the 2nd wraps
    assert ray.get(c.sums.remote(refs)) == ([float(i * (100 + i)) for i in range(4)], {"gloo": 4})
    g = gloo.Group("g", "gloo", 0, 2, pg=None)
    g._next_tag = gloo.TAG_LIMIT - 10
    assert [g.tags(4), g.tags(4), g.tags(4), g.tags(1)] == [gloo.TAG_LIMIT - 10, gloo.TAG_LIMIT - 6, 1, 5]


async def test_create_from_a_loop_needs_the_async_twin(outsiders):
    a, b = outsiders
    with pytest.raises(RuntimeError, match="create_collective_group_async"):
        rdt.create_collective_group([a, b])
    g = await rdt.create_collective_group_async([a, b])
    await rdt.destroy_collective_group_async(g)
    assert isinstance(asyncio.get_running_loop(), asyncio.AbstractEventLoop)


@rdt.remote
class SlowToStart:
    def __init__(self) -> None:
        time.sleep(1.5)  # a member still starting (3 times the caller's deadline): its ping waits

    def ping(self) -> str:
        return "pong"


async def test_a_group_creation_cut_short_by_the_callers_timeout_is_a_timeout_and_frees_the_name(outsiders):
    """The caller's deadline is not a member's fault: TimeoutError, not CollectiveGroupError
    blaming a member, and the name is free again."""
    a, _ = outsiders
    b = SlowToStart.remote()  # fresh: a member still starting
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rdt.create_collective_group_async([a, b], name="cut-short"), 0.5)
        assert await asyncio.wrap_future(b.ping.remote().future()) == "pong"
        g = await rdt.create_collective_group_async([a, b], name="cut-short")  # the name is free
        await rdt.destroy_collective_group_async(g)
    finally:
        ray.kill(b)


@rdt.remote
class Listening:
    @rdt.method(tensor_transport="gloo")
    async def make(self, n: int, fill: float):
        return {"w": torch.full((n,), fill)}

    async def sums(self, refs):
        return await sums_and_transports(refs)

    async def listening(self) -> list[str]:
        """The IPv4 addresses this process listens on (from /proc: its own sockets only)."""
        return sorted({addr for addr, _ in listening() if ":" not in addr})


def test_gloo_listens_on_the_interface_gloo_socket_ifname_names():
    env = {"runtime_env": {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}}
    a, b = Listening.options(**env).remote(), Listening.options(**env).remote()
    g = rdt.create_collective_group([a, b])
    try:
        assert ray.get(b.sums.remote([a.make.remote(1000, 2.0)])) == ([2000.0], {"gloo": 1})
        node_ip = ray.util.get_node_ip_address()
        for member in (a, b):
            addresses = ray.get(member.listening.remote())
            assert "127.0.0.1" in addresses and node_ip not in addresses, addresses
    finally:
        rdt.destroy_collective_group(g)
        ray.kill(a)
        ray.kill(b)


def test_a_group_name_left_behind_by_dead_members_can_be_freed_by_name(outsiders):
    """A job that ended without destroying its group leaves the name claimed in the GCS:
    creating it again says how to free it, and freeing it by name works once its members
    are gone (never while they live: they must leave it)."""
    a, b = GlooProducer.remote(), AsyncMember.remote()
    g = rdt.create_collective_group([a, b], name="left-behind")
    with pytest.raises(rdt.CollectiveGroupError, match=r"still has live members \(ranks 0, 1\)"):
        rdt.destroy_collective_group("left-behind")
    ray.kill(a)
    ray.kill(b)
    c, d = outsiders
    with pytest.raises(
        rdt.CollectiveGroupError,
        match=r"named 'left-behind' exists: destroy it .*rdt.destroy_collective_group\('left-behind'\)",
    ):
        rdt.create_collective_group([c, d], name="left-behind")
    wait_until(lambda: _freed_by_name("left-behind"), 30, lambda: "its members seen dead")
    g = rdt.create_collective_group([c, d], name="left-behind")
    rdt.destroy_collective_group(g)


def _freed_by_name(name: str) -> bool:
    try:
        rdt.destroy_collective_group(name)
        return True
    except rdt.CollectiveGroupError:
        return False  # Ray has not marked them dead yet


def test_a_state_dict_of_many_small_tensors_arrives_exact_packed_into_one_message(pair):
    # Small tensors travel packed into one message (thousands of messages took ~50 us each):
    # every dtype and size lands byte for byte, in the fetch's own memory and into buffers
    # contiguous, strided and parameters alike, beside large and empty ones sent apart.
    from rdt_async.transports import gloo

    p, c, _, _ = pair
    got = ray.get(c.experts_into.remote([p.experts.remote(3000)]), timeout=120)
    assert got == (True, True, float(sum(range(1 << 17))), 7.5, 3003), got
    specs = [((i % 37 + 1,), torch.float32) for i in range(5)] + [((1 << 17,), torch.float32), ((0,), torch.float32)]
    packed, offsets, size = gloo._packing(specs)
    assert packed == [0, 1, 2, 3, 4] and offsets == [0, 64, 128, 192, 256] and size == 320
    assert gloo._packing([((4,), torch.float32), ((1 << 17,), torch.float32)]) == ([], [], 0)  # one alone: as it was


def test_a_send_asked_for_in_an_earlier_creation_of_a_group_never_goes_out_in_the_next(tmp_path):
    # Tags start again at 1 in a group made anew under its name (the documented recovery
    # from a broken group): a request left by a fetch that ended before, served after it,
    # sent its object at tag 1 of the new group, and the consumer's first fetch there
    # took those bytes as its own, with no error. Two plain processes, no Ray.
    import gloo_pair

    with gloo_pair.running(gloo_pair.producer, gloo_pair.consumer, str(tmp_path / "first"), str(tmp_path / "second")) as (
        sent, got_in,
    ):
        assert got_in.poll(90), "the consumer's fetch did not end"
        got = got_in.recv()
        said = sent.recv() if sent.poll(30) else "no word from the producer"
    assert got == [222.0, 222.0, 222.0], got  # the new object's own bytes, not the old request's
    assert said.startswith("CollectiveGroupError: a send over group 'g' was asked for another creation of it"), said


def test_a_freed_objects_refusal_lands_before_the_fetch_returns_never_after(tmp_path):
    # A producer that no longer holds the object answers "freed" and sends zeros to
    # complete the consumer's posted receives; the consumer raised at the answer, and the
    # zeros landed in its `into=` buffer afterwards, in the caller's hands by then.
    import gloo_pair

    with gloo_pair.running(gloo_pair.producer_freed, gloo_pair.consumer_freed, str(tmp_path / "group")) as (_, got_in):
        assert got_in.poll(90), "the consumer's fetch did not end"
        said, when_it_ended, later = got_in.recv()
    assert said == "ObjectFreedError"
    assert when_it_ended == later, (when_it_ended, later)  # nothing wrote the buffer after the fetch ended


def test_zeros_sent_for_an_altered_refs_specs_cost_the_producer_no_memory():
    # The MISMATCH answer sends zeros of the specs the consumer's ref gave (maybe crafted):
    # torch.zeros wrote each page (2 GiB of RSS for a ref claiming 2 GiB).
    from rdt_async.transports import gloo

    def rss_mib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

    before = rss_mib()
    zeros = gloo._zeros([((1 << 28,), torch.float32), ((3, 5), torch.int64)], "cpu")  # 1 GiB claimed
    assert [(tuple(z.shape), z.dtype) for z in zeros] == [((1 << 28,), torch.float32), ((3, 5), torch.int64)]
    assert float(zeros[0][:: 1 << 12].sum()) == 0.0 and not zeros[1].any()  # read as a send reads them
    assert rss_mib() - before < 64, rss_mib() - before


async def test_a_cancelled_fetchs_receives_are_waited_for_up_to_the_groups_own_timeout(monkeypatch):
    # Aborting a Gloo group does not end a receive posted in it (a send that arrived after
    # the abort still landed in the caller's buffers); its timeout does. A group made with
    # a timeout over DRAIN_S had its cancelled fetches hand the buffers back at DRAIN_S.
    from rdt_async.transports import gloo

    aborted: list[str] = []
    monkeypatch.setattr(gloo, "DRAIN_S", 0.2)
    monkeypatch.setattr(gloo.groups, "abort", lambda name, why: aborted.append(why))
    group = gloo.Group("drained", "gloo", 0, 2, pg=None, timeout_s=1.0)
    landing = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.8, landing.set_result, None)  # lands at 0.8 s, past DRAIN_S
    began = time.monotonic()
    await gloo._drain(group, landing)
    assert landing.done() and aborted == [] and 0.7 < time.monotonic() - began < 1.5
    never = asyncio.get_running_loop().create_future()
    await gloo._drain(group, never)  # past the group's timeout too: aborted
    assert aborted == ["a cancelled fetch's receives did not complete in 2 s"], aborted
