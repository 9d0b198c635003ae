"""Gloo groups and what they trust: the rendezvous goes through Ray's GCS (no port of
torch's store), its keys stay inside their group and go with it, Gloo listens on the
node's address only, and a ref's group metadata is checked before anything is posted."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import ray
import torch
from conftest import wait_until
from helpers import checksum
from probes import listening
from ray.experimental import internal_kv

import rdt_async as rdt
from rdt_async.collective import KV_NAMESPACE

pytestmark = pytest.mark.usefixtures("ray_session")


@rdt.remote
class Member:
    @rdt.method(tensor_transport="gloo")
    async def make(self, n: int, fill: float):
        return {"w": torch.full((n,), fill), "i": torch.arange(n % 7, dtype=torch.int64)}

    async def listening(self) -> list[tuple[str, int]]:
        return sorted(listening())

    async def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    async def fetch_sum(self, refs) -> tuple[float, dict]:
        import collections

        before = collections.Counter(rdt.store_stats()["fetches"])
        value = await rdt.fetch(await refs[0])
        used = dict(collections.Counter(rdt.store_stats()["fetches"]) - before)
        return checksum(value["w"]), used

    async def crafted_fetches(self, refs, group: str, ranks: list, shapes: list, anonymous: tuple = ()) -> list[str]:
        """Fetch the ref altered in each way given; return each failure as 'Type: message'."""
        obj = await refs[0]
        backend, _ = obj.meta["groups"][group]
        crafted = [dataclasses.replace(obj, meta={**obj.meta, "groups": {group: (backend, r)}}) for r in ranks]
        for shape, dtype in shapes:
            numel = math.prod(shape) if min(shape, default=0) >= 0 else 0
            nbytes = numel * dtype.itemsize if min(shape, default=0) >= 0 else obj.specs[0].nbytes
            # (a consistent spec: the core's spec check lets it through to the group's own)
            spec = dataclasses.replace(obj.specs[0], shape=tuple(shape), dtype=dtype, nbytes=nbytes)
            crafted.append(dataclasses.replace(obj, specs=(spec, *obj.specs[1:])))
        for r in anonymous:  # a producer with no actor id (no member's), said to be rank r
            producer = dataclasses.replace(obj.producer, actor_id=None, actor_state=None, serves=False)  # (as a driver's)
            crafted.append(dataclasses.replace(obj, producer=producer, meta={**obj.meta, "groups": {group: (backend, r)}}))
        out = []
        for c in crafted:
            try:
                await rdt.fetch(c)
                out.append("fetched")
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    async def joining(self) -> int:
        """How many threads of this process are inside the gloo transport's join now."""
        import sys

        from rdt_async.transports import gloo

        def inside(frame) -> bool:
            while frame is not None:
                if frame.f_code.co_name == "join" and frame.f_code.co_filename == gloo.__file__:
                    return True
                frame = frame.f_back
            return False

        return sum(inside(f) for f in sys._current_frames().values())

    async def refuse_joins(self) -> None:
        """Fault injection: this member's next joins fail at once (after the others began theirs)."""
        from rdt_async.transports import gloo

        def join(*args, **kwargs):
            time.sleep(1.0)  # the others have written their keys and wait for ours
            raise RuntimeError("this member refuses to join (test)")

        gloo.join = join


@pytest.fixture(scope="module")
def members(cluster):
    """Four members, in no group between tests: each test makes its groups and destroys them."""
    ms = [Member.remote() for _ in range(4)]
    yield ms
    for m in ms:
        ray.kill(m)


@pytest.fixture
def four(members):
    yield members
    assert ray.get([m.joining.remote() for m in members]) == [0] * 4  # still answering, no join under way


def _rendezvous_keys() -> list[bytes]:
    return sorted(internal_kv._internal_kv_list("rdv/", namespace=KV_NAMESPACE))


def _of(name: str) -> str:
    return f"rdv/{name.encode().hex()}/"


def test_no_port_is_opened_for_the_rendezvous_and_gloo_listens_on_the_node_address_only(four):
    """Each member's only new listener is Gloo's, on its Ray node IP: no TCPStore (which
    listened on every interface, for anyone who reached it) in rank 0 or elsewhere."""
    members = four[:3]
    before = ray.get([m.listening.remote() for m in members])
    ips = ray.get([m.node_ip.remote() for m in members])
    g = rdt.create_collective_group(members)
    try:
        during = ray.get([m.listening.remote() for m in members])
        for rank, (was, now, ip) in enumerate(zip(before, during, ips)):
            new = set(map(tuple, now)) - set(map(tuple, was))
            assert [addr for addr, _ in new] == [ip], f"rank {rank} opened {sorted(new)} (node IP {ip})"
        assert ray.get(members[1].fetch_sum.remote([members[0].make.remote(100, 2.0)])) == (200.0, {"gloo": 1})
    finally:
        rdt.destroy_collective_group(g)
    after = ray.get([m.listening.remote() for m in members])
    for rank, (was, now) in enumerate(zip(before, after)):
        assert set(map(tuple, now)) <= set(map(tuple, was)), f"rank {rank} still listens on {sorted(map(tuple, now))}"


def test_the_rendezvous_keys_live_in_the_gcs_under_their_group_and_go_with_it(four):
    a, b, c, d = four
    assert not [k for k in _rendezvous_keys() if k.startswith(_of("kv-two").encode())]
    g2 = rdt.create_collective_group([a, b], name="kv-two")
    g4 = rdt.create_collective_group([a, b, c, d], name="kv-four")
    try:
        mine = {n: [k for k in _rendezvous_keys() if k.startswith(_of(n).encode())] for n in ("kv-two", "kv-four")}
        assert len(mine["kv-two"]) == 2 and len(mine["kv-four"]) == 4, mine  # Gloo: one address per rank
        rdt.destroy_collective_group(g2)
        assert not [k for k in _rendezvous_keys() if k.startswith(_of("kv-two").encode())]
        assert [k for k in _rendezvous_keys() if k.startswith(_of("kv-four").encode())] == mine["kv-four"]
        assert ray.get(d.fetch_sum.remote([a.make.remote(10, 3.0)])) == (30.0, {"gloo": 1})
    finally:
        rdt.destroy_collective_group(g4)
    assert not [k for k in _rendezvous_keys() if k.startswith((_of("kv-two").encode(), _of("kv-four").encode()))]


def test_a_failed_creation_leaves_no_key_and_ends_the_others_joins_at_once(four):
    a, b = four[:2]
    c = Member.remote()  # fresh: its joins fail from now on
    ray.get(c.refuse_joins.remote())
    t0 = time.monotonic()
    with pytest.raises(
        rdt.CollectiveGroupError, match=r"creating collective group 'refused' failed in member 2 \(actor \w{8}\): .*refuses to join"
    ):
        rdt.create_collective_group([a, b, c], name="refused", timeout_s=60)
    assert time.monotonic() - t0 < 20
    # The others' joins ended with the creation (not after timeout_s), and left no key behind.
    wait_until(lambda: ray.get([a.joining.remote(), b.joining.remote()]) == [0, 0], 10, lambda: "joins still under way")
    assert not [k for k in _rendezvous_keys() if k.startswith(_of("refused").encode())]
    g = rdt.create_collective_group([a, b], name="refused")  # the name is free, the members are fine
    assert ray.get(b.fetch_sum.remote([a.make.remote(10, 1.0)])) == (10.0, {"gloo": 1})
    rdt.destroy_collective_group(g)
    ray.kill(c)


def test_crafted_group_names_stay_in_their_own_keys(four):
    """Names are user input: one that is a prefix of another, or that looks like a path or
    like another group's keys, neither reads, clobbers nor deletes another group's keys.
    (The same two actors are in every group: each creation's rendezvous found its own keys.)"""
    names = ["a", "ab", "a/", "a/0", "../a", "rdv/" + b"a".hex() + "/x", ""]
    p, c = four[:2]
    groups = [rdt.create_collective_group([p, c], name=n or None) for n in names]
    try:
        keys = _rendezvous_keys()
        for g in groups:
            assert len([k for k in keys if k.startswith(_of(g.name).encode())]) == 2, (g.name, keys)
        rdt.destroy_collective_group(groups[0])  # "a": a prefix of "ab" and of "a/..."
        left = _rendezvous_keys()
        for g in groups[1:]:
            assert len([k for k in left if k.startswith(_of(g.name).encode())]) == 2, (g.name, left)
        assert ray.get(c.fetch_sum.remote([p.make.remote(10, 3.0)])) == (30.0, {"gloo": 1})
    finally:
        for g in groups[1:]:
            rdt.destroy_collective_group(g)
    assert not [k for k in _rendezvous_keys() if k.startswith(tuple(_of(g.name).encode() for g in groups))]
    with pytest.raises(rdt.CollectiveGroupError, match="a group's name is a str of at most 256 characters, not int"):
        rdt.create_collective_group([p, c], name=7)


def test_a_crafted_ref_is_refused_before_anything_is_posted_and_the_group_stays_usable(four):
    """A ref's group metadata came from another process: a rank that is no rank, a
    producer that is no member, or tensors described otherwise than the producer holds
    them give a clear TransferError, and the very next good fetch over the group works.
    Another rank (out of range, our own, a bystander's) is not followed: the receive is
    posted from the rank the group gives the producer's actor (a group made anew under its
    name may have moved it since the object was made)."""
    p, c, bystander = four[:3]
    g = rdt.create_collective_group([p, c, bystander])
    try:
        ref = p.make.remote(1000, 2.0)
        errors = ray.get(
            c.crafted_fetches.remote(
                [ref],
                g.name,
                [5, -1, "0", True, 1, 2],
                [((1001,), torch.float32), ((1000,), torch.float64), ((-3,), torch.float32)],
                (2, 0),
            ),
            timeout=120,
        )
        expected = [
            "fetched",  # rank 5: not followed
            r"TransferError: fetch of \w+ over group '.*': its ref says the producer is rank -1, not a rank of this group of 3",
            r"TransferError: .* the producer is rank '0', not a rank",
            r"TransferError: .* the producer is rank True, not a rank",
            "fetched",  # rank 1 (ours): not followed
            "fetched",  # rank 2 (a bystander's): not followed
            r"TransferError: gloo fetch of \w+: its ref describes tensors \[float32\[1001\], int64\[6\]\], but its "
            r"producer holds \[float32\[1000\], int64\[6\]\]: the ref was altered, or is not this object's; nothing "
            r"was received \(the group is unharmed\)",
            r"TransferError: .* describes tensors \[float64\[1000\], int64\[6\]\], but its producer holds \[float32\[1000\]",
            r"TransferError: .*(its ref describes a tensor as torch.float32\[-3\]@cpu \(the ref was altered\)"
            r"|tensor 0's spec is not one a producer makes: shape \(-3,\))",
            r"TransferError: .* its producer \(driver/process \d+\) holds no rank of this group \(the group was made "
            r"anew without it since the object was made, or the ref was altered\); nothing was received",
            r"TransferError: .* its producer \(driver/process \d+\) holds no rank of this group",
        ]
        assert len(errors) == len(expected)
        import re

        for got, want in zip(errors, expected):
            assert re.fullmatch(want + ".*", got, re.S), (want, got)
        assert ray.get(c.fetch_sum.remote([ref]), timeout=60) == (2000.0, {"gloo": 1})  # the group is fine
        assert ray.get(bystander.fetch_sum.remote([p.make.remote(10, 1.0)]), timeout=60) == (10.0, {"gloo": 1})
    finally:
        rdt.destroy_collective_group(g)
