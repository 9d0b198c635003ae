"""A collective group's life (create, join, break, leave, destroy, made anew under its name),
without a cluster: real Gloo process groups, made by the `gloo` transport's `join`, in this
process (groups of one member) or with a spawned member (`gloo_pair.peer`); Ray's GCS
key-value store is a dict here, and the member calls a creator sends are served in this
process, as a member's `rdt` group serves them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types

import pytest
import ray
import torch
import torch.distributed as dist
from ray.experimental import internal_kv

import rdt_async as rdt
from rdt_async import _io
from rdt_async.collective import _checks, _groups, _member, _records
from rdt_async.collective._messages import Allreduce, Break, Join, Leave
from rdt_async.transports import gloo
from rdt_async.transports._base import TensorSpec, TransferInfo
from rdt_async.transports._kvstore import KVStore

TS = 2.0  # each group's timeout_s


class ActorId:
    def __init__(self, h: str) -> None:
        self.h = h

    def hex(self) -> str:
        return self.h


class Actor:
    """A member as create and destroy see it: an actor id, and an `rdt` group (this process)."""

    def __init__(self, h: str) -> None:
        self._actor_id = ActorId(h)
        self.rdt__group = None


A, B = Actor("aa" * 16), Actor("bb" * 16)


@pytest.fixture
def gcs(monkeypatch):
    """Ray's GCS key-value store as a dict; members' calls served here, in a thread."""
    kv: dict[tuple[str | None, str], bytes] = {}

    def put(key, value, overwrite=True, *, namespace=None):
        had = (namespace, key) in kv
        if overwrite or not had:
            kv[namespace, key] = value
        return had

    def delete(key, del_by_prefix=False, *, namespace=None):
        gone = [k for k in kv if k[0] == namespace and (k[1].startswith(key) if del_by_prefix else k[1] == key)]
        for k in gone:
            del kv[k]
        return len(gone)

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, *, namespace=None: kv.get((namespace, key)))
    monkeypatch.setattr(internal_kv, "_internal_kv_del", delete)
    monkeypatch.setattr(internal_kv, "_internal_kv_list", lambda p, *, namespace=None: [k[1] for k in kv if k[1].startswith(p)])
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")

    async def call(actor, msg):
        if isinstance(msg, Join) and msg.rank == 1 and actor is B:
            raise RuntimeError("this member cannot join (test)")
        return await asyncio.to_thread(_member.serve, msg)

    monkeypatch.setattr(_groups, "call", call)
    monkeypatch.setattr(ray.actor, "ActorHandle", Actor)  # (create checks its members are actor handles)
    yield kv
    gloo.leave("g")


def record(kv) -> dict | None:
    blob = kv.get((_records.KV_NAMESPACE, "group/g"))
    return None if blob is None else json.loads(blob)


async def test_destroying_a_stale_handle_leaves_the_group_made_anew_under_its_name(gcs):
    # A handle that outlived its group (destroyed, then made anew under its name by
    # another driver) tore the new group down: its members left it, its record and keys
    # were deleted, and a third create of the name succeeded while the second's holder used it.
    first = await rdt.create_collective_group_async([A], name="g", timeout_s=TS)
    await rdt.destroy_collective_group_async(first)
    await rdt.create_collective_group_async([A], name="g", timeout_s=TS)
    made = gloo.groups.get("g")
    await rdt.destroy_collective_group_async(first)  # stale: a second destroy, or another driver's
    assert gloo.groups.get("g") is made  # still in it
    assert record(gcs) is not None and record(gcs)["creation"] == made.creation  # the name still claimed
    assert _member.serve(Leave("g", first.creation)) is False  # a Leave that comes late
    assert gloo.groups.get("g") is made
    with pytest.raises(rdt.CollectiveGroupError, match="'g' was destroyed and made anew since this CollectiveGroup"):
        await _checks.pick_group("allreduce", [], [], first)  # a collective given the stale handle
    with pytest.raises(rdt.CollectiveGroupError, match="named 'g' exists"):
        await rdt.create_collective_group_async([A], name="g", timeout_s=TS)
    rebuilt = rdt.CollectiveGroup("g", "gloo", (A,))  # a handle rebuilt by hand: whichever holds the name
    await rdt.destroy_collective_group_async(rebuilt)
    assert gloo.groups.get("g") is None and record(gcs) is None and not gcs


async def test_a_create_cancelled_while_it_claims_the_name_gives_the_name_back(gcs, monkeypatch):
    # The caller's deadline fell while the claim of the name was in the GCS (a thread):
    # the claim went on, nothing undid it, and the name stayed taken for good (create
    # said "exists", destroy by name "still has live members").
    put = internal_kv._internal_kv_put

    def slow_put(*args, **kwargs):
        time.sleep(0.3)  # a GCS round trip under load
        return put(*args, **kwargs)

    monkeypatch.setattr(internal_kv, "_internal_kv_put", slow_put)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await rdt.create_collective_group_async([A], name="g", timeout_s=TS)
    assert record(gcs) is None and gloo.groups.get("g") is None
    g = await rdt.create_collective_group_async([A], name="g", timeout_s=TS)
    await rdt.destroy_collective_group_async(g)


async def test_a_failed_join_names_the_member_and_frees_the_name(gcs):
    with pytest.raises(
        rdt.CollectiveGroupError,
        match=r"creating collective group 'g' failed in member 1 \(actor bbbbbbbb\): RuntimeError: this member cannot join",
    ):
        await rdt.create_collective_group_async([A, B], name="g", timeout_s=TS)
    assert record(gcs) is None and gloo.groups.get("g") is None and not gcs  # rank 0's join ended too


@pytest.mark.parametrize("timeout_s", [0, -1, 0.0, 0.0005, 1e-7, float("nan"), float("inf"), 1e12, "5", True, None])
async def test_timeout_s_is_a_positive_number_of_seconds_checked_at_the_call(gcs, timeout_s):
    # -1 failed in every member (Gloo's "Invalid timeout"); 0 made every operation fail
    # at once while the rendezvous took it as no limit.
    with pytest.raises(rdt.CollectiveGroupError, match=r"timeout_s bounds each operation .* from 0.001 .* and under 1e\+09, not"):
        await rdt.create_collective_group_async([A], name="g", timeout_s=timeout_s)
    with pytest.raises(rdt.CollectiveGroupError, match="timeout_s bounds each operation"):
        gloo.join("g", "gloo", 0, 1, kv=_records.GroupKV("g", "c"), host="127.0.0.1", attempt="c", timeout_s=timeout_s)
    assert record(gcs) is None and gloo.groups.get("g") is None


def test_an_actor_listed_twice_is_named_by_both_places(gcs):
    with pytest.raises(rdt.CollectiveGroupError, match=r"appears twice .*actors\[0\] and actors\[2\] are both actor aaaaaaaa"):
        rdt.create_collective_group([A, B, A], name="g")


def test_break_and_parts_reach_only_the_creation_they_were_issued_in(gcs):
    # A Break by name (a collective of the group's earlier creation failed late) broke
    # the group made anew under it; a part issued in the earlier one ran in the new one.
    g = rdt.create_collective_group([A], name="g", timeout_s=TS)
    part = Allreduce(group="g", creation="an earlier one", rank=0, size=1, specs=(), obj_id=None, skeleton=None)
    with pytest.raises(rdt.CollectiveGroupError, match="group 'g' was made anew since the caller looked it up"):
        _member.serve(part)
    assert _member.serve(Break("g", "an earlier one", "rdt.allreduce failed")) is False
    assert gloo.groups.get("g").broken is None
    assert _member.serve(Break("g", g.creation, "rdt.allreduce failed")) is True
    assert gloo.groups.get("g").broken == "rdt.allreduce failed"
    rdt.destroy_collective_group(g)


def test_records_and_joins_from_elsewhere_are_checked(gcs, monkeypatch):
    for junk in (b"[1]", b"{}", b'{"backend": "gloo", "actors": "aa", "creation": "c"}',
                 b'{"backend": "gloo", "actors": ["not hex"], "creation": "c"}', b"not json"):  # fmt: skip
        gcs[_records.KV_NAMESPACE, "group/g"] = junk
        with pytest.raises(rdt.CollectiveGroupError, match=r"the record of collective group 'g' .* is not one"):
            rdt.destroy_collective_group("g")
    del gcs[_records.KV_NAMESPACE, "group/g"]
    for rank, size, members in ((3, 2, ("aa", "bb")), (0, 0, ()), (-1, 1, ("aa",)), (0, 2, ("aa",))):
        with pytest.raises(rdt.CollectiveGroupError, match=r"group 'g': .*rank|members named for"):
            _member.serve(Join("g", "gloo", rank, size, members, "c", TS))
    assert gloo.groups.get("g") is None and not gcs


def test_an_actor_ray_no_longer_knows_is_dead_to_destroy_by_name(gcs, monkeypatch):
    # The GCS forgets dead actors (a job's, some minutes after it ended): such a member
    # counted as live, and the name of a group left behind could never be freed.
    from ray._private import state

    known = {"aa" * 16: {"State": "ALIVE"}, "cc" * 16: {"State": "DEAD"}}  # bb...: forgotten
    monkeypatch.setattr(state, "actors", lambda actor_id: known.get(actor_id, {}))
    rec = {"backend": "gloo", "actors": ["aa" * 16, "bb" * 16, "cc" * 16], "creation": "c"}
    assert _records.live_members(rec) == [0]
    gcs[_records.KV_NAMESPACE, "group/g"] = json.dumps({**rec, "actors": ["bb" * 16, "cc" * 16]}).encode()
    rdt.destroy_collective_group("g")
    assert record(gcs) is None


@pytest.mark.parametrize(
    ("verb", "dtype", "op", "refused"),
    [
        ("allreduce", torch.int16, "sum", r"tensor 0 is int16\[4\]@cuda:0, and NCCL reduces no int16 tensors; convert them"),
        ("reduce_scatter", torch.uint64, "max", "NCCL reduces no uint64 tensors"),
        ("allreduce", torch.float8_e4m3fnuz, "sum", "NCCL reduces no float8_e4m3fnuz tensors"),
        ("allreduce", torch.complex64, "max", r"allreduce\(op='max'\): .*NCCL reduces complex64 tensors only in allreduce by 'sum' or 'avg'"),
        ("reduce_scatter", torch.complex64, "sum", r"only in allreduce .* return torch.view_as_real\(t\)"),
        ("allreduce", torch.complex64, "avg", None),
        ("allreduce", torch.bfloat16, "prod", None),
        ("reduce_scatter", torch.bool, "min", None),
    ],
)
def test_what_nccl_cannot_reduce_is_refused_before_anything_is_sent(verb, dtype, op, refused):
    # NCCL's dtype and op table went unchecked: torch raised it inside the collective, in
    # every member, which broke the group (the check is the caller's: no GPU needed).
    value = types.SimpleNamespace(specs=(TensorSpec((4,), dtype, "cuda:0", 4 * dtype.itemsize),))
    if refused is None:
        _checks.check_reducible(verb, value, "nccl", op)
    else:
        with pytest.raises(ValueError, match=refused):
            _checks.check_reducible(verb, value, "nccl", op)


@pytest.mark.parametrize("has_float8", [False, True])
def test_nccl_float8_reductions_are_refused_where_torchs_nccl_has_none(monkeypatch, has_float8):
    # torch refuses float8 reductions, inside the collective, where its NCCL is older than 2.24.
    monkeypatch.setattr(_checks, "_nccl_has_float8", lambda: has_float8)
    value = types.SimpleNamespace(specs=(TensorSpec((4,), torch.float8_e5m2, "cuda:0", 4),))
    if has_float8:
        _checks.check_reducible("allreduce", value, "nccl", "sum")
    else:
        with pytest.raises(ValueError, match=r"the NCCL torch loads here reduces no float8 tensors \(NCCL 2.24"):
            _checks.check_reducible("allreduce", value, "nccl", "sum")


def test_a_ref_made_before_the_group_was_made_anew_finds_its_producer_by_actor(monkeypatch):
    # An object names its producer's rank when it was made; the group made anew in
    # another order put that actor elsewhere, and the fetch failed as an altered ref.
    monkeypatch.setattr(gloo, "groups", type(gloo.groups)())
    gloo.groups.add(gloo.Group("g", "gloo", 0, 3, None, members=("cc" * 16, "aa" * 16, "bb" * 16), creation="new"))

    def info(actor_id: str | None, src: int) -> TransferInfo:
        made_by = types.SimpleNamespace(actor_id=actor_id, label=f"actor {str(actor_id)[:8]}")
        spec = TensorSpec((4,), torch.float32, "cpu", 16)
        return TransferInfo("0" * 24, (spec,), gloo.GlooMeta("g", src), hold=types.SimpleNamespace(producer=made_by))

    group, src = gloo.checked_source(info("bb" * 16, 1), "cpu")  # rank 1 then, rank 2 now
    assert (group.creation, src) == ("new", 2)
    with pytest.raises(rdt.TransferError, match=r"its producer \(actor dddddddd\) holds no rank of this group \(the group was made anew"):
        gloo.checked_source(info("dd" * 16, 1), "cpu")
    with pytest.raises(rdt.TransferError, match="this process's own rank"):
        gloo.checked_source(info("cc" * 16, 1), "cpu")


def test_a_join_given_up_while_stuck_never_holds_up_the_next_creation():
    # A join that closing its store cannot end (Gloo connecting to a member that died
    # after saying where it listens; here: a key-value read that hangs) held the name:
    # the next creation's join was refused ("already joining a group named 'g'").
    release = threading.Event()

    class Stuck:
        def put(self, key, value, *, overwrite=True):
            return False

        def get(self, key):
            release.wait(10)  # (past its store's close: as a connect is)
            return None

        def delete(self, key):
            return False

        def count(self, prefix):
            return 0

    outcome: list[str] = []

    def stuck_join() -> None:
        try:
            gloo.join("g", "gloo", 0, 2, kv=Stuck(), host="127.0.0.1", attempt="c0", timeout_s=TS)
            outcome.append("joined")
        except rdt.CollectiveGroupError as exc:
            outcome.append(str(exc))

    first = threading.Thread(target=stuck_join)
    first.start()
    try:
        time.sleep(0.2)
        assert gloo.leave("g", "c0") is False  # the caller gave c0 up: its join is told
        gloo.join("g", "gloo", 0, 1, kv=_DictKV(), host="127.0.0.1", attempt="c1", timeout_s=TS)
        assert gloo.groups.get("g").creation == "c1"
    finally:
        release.set()
        first.join(10)
        assert gloo.groups.get("g") is None or gloo.groups.get("g").creation == "c1"
        gloo.leave("g")
    assert outcome == ["group 'g' was torn down while this member joined it"], outcome


def test_joins_given_up_while_stuck_run_on_in_at_most_a_few_threads():
    # Each creation given up while a member connected to one that died left a thread
    # connecting for ~5x timeout_s; retries piled them up until the member's group calls
    # (its Leaves and collectives too) had no thread left.
    release = threading.Event()

    class Stuck(_DictKV):  # a member that said where it listens, then died
        def get(self, key):
            release.wait(10)  # (past its store's close: as Gloo's connect is)
            return None

    def stuck_join(name: str) -> threading.Thread:
        def join() -> None:
            with pytest.raises(rdt.CollectiveGroupError, match="torn down while this member joined it"):
                gloo.join(name, "gloo", 0, 2, kv=Stuck(), host="127.0.0.1", attempt=f"{name}-given-up", timeout_s=TS)

        t = threading.Thread(target=join)
        t.start()
        return t

    baseline = threading.active_count()
    stuck = []
    try:
        for i in range(gloo.GIVEN_UP_JOINS):
            stuck.append(stuck_join(f"g{i}"))
            time.sleep(0.1)
            gloo.leave(f"g{i}", f"g{i}-given-up")  # the caller gave the creation up
            if i == 0:  # a retry is not refused
                gloo.join("g0", "gloo", 0, 1, kv=_DictKV(), host="127.0.0.1", attempt="g0-again", timeout_s=TS)
                assert gloo.leave("g0", "g0-again") is True
        with pytest.raises(rdt.CollectiveGroupError, match=(
            rf"cannot join group 'g' now: {gloo.GIVEN_UP_JOINS} joins of creations that were given up still connect "
            r"to members that died \(Gloo ends each within about 5x its timeout_s.*create the group again once")):  # fmt: skip
            gloo.join("g", "gloo", 0, 1, kv=_DictKV(), host="127.0.0.1", attempt="c", timeout_s=TS)
        assert threading.active_count() == baseline + gloo.GIVEN_UP_JOINS
    finally:
        release.set()
        for t in stuck:
            t.join(10)
    assert threading.active_count() == baseline
    gloo.join("g", "gloo", 0, 1, kv=_DictKV(), host="127.0.0.1", attempt="c", timeout_s=TS)
    assert gloo.leave("g", "c") is True


def test_a_transfer_over_the_pair_hands_the_backend_only_what_nccl_carries():
    # NCCL's point-to-point carries only the dtypes in its table: a tensor sent alone
    # (64 KiB or more) of int16 or complex64 failed inside the transfer, which broke the
    # group. Here: a real Gloo pair in this process, behind NCCL's table.
    carries = {torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64}  # fmt: skip

    class NcclTable:
        def __init__(self, pg):
            self.pg = pg

        def _checked(self, tensors):
            for t in tensors:
                if t.dtype not in carries:
                    raise TypeError(f"Unconvertible NCCL type {t.dtype}")
            return tensors

        def send(self, tensors, dst, tag):
            return self.pg.send(self._checked(tensors), dst, tag)

        def recv(self, tensors, src, tag):
            return self.pg.recv(self._checked(tensors), src, tag)

    kv = _DictKV()
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    other = []  # rank 1, not in this process's registry: the producer
    joined = threading.Thread(target=lambda: other.append(dist.ProcessGroupGloo(KVStore(kv, TS, "rank 1"), 1, 2, opts)))
    joined.start()
    gloo.join("g", "gloo", 0, 2, kv=kv, host="127.0.0.1", attempt="c", timeout_s=TS)
    joined.join(10)
    try:
        gloo.groups.get("g").pg = NcclTable(gloo.groups.get("g").pg)
        producer = gloo.Group("g", "gloo", 1, 2, NcclTable(other[0]), creation="c")
        value = [torch.arange(40_000, dtype=torch.int16), torch.full((10_000,), 1 + 2j), torch.ones(3, dtype=torch.uint16)]
        t = gloo.GlooTransport()

        class Serves:
            async def request_send(self, request):  # (rank 1's side of send_multiple_tensors)
                await t._send(producer, request["dst"], request["tag"], value, gloo.HELD)

        info = TransferInfo("0" * 24, tuple(TensorSpec.of(x) for x in value), gloo.GlooMeta("g", 1))
        got = _io.start(t.receive(info, None, Serves())).result(timeout=20)
        assert [(x.dtype, x.tolist()) for x in got] == [(x.dtype, x.tolist()) for x in value]
    finally:
        gloo.leave("g")
        other[0].shutdown()


class _DictKV:
    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def put(self, key, value, *, overwrite=True):
        had = key in self.d
        if overwrite or not had:
            self.d[key] = value
        return had

    def get(self, key):
        return self.d.get(key)

    def delete(self, key):
        return self.d.pop(key, None) is not None

    def count(self, prefix):
        return 0


# -- with a member in another process -----------------------------------------------------


@pytest.fixture(scope="module")
def port():
    """The port of a TCPStore served here, where the spawned member and this process meet."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server.port
    del server


@pytest.fixture(scope="module")
def peer(port):
    """Rank 1 of group "g", in a spawned process (`gloo_pair.peer`): a test leaves what it joined."""
    import gloo_pair

    with gloo_pair.spawned(gloo_pair.peer, port, TS) as conn:
        yield conn


def _join_with(peer, port: int, creation: str, *, kv=None) -> tuple[str, str]:
    """Join creation `creation` of "g" as rank 0 while the peer joins as rank 1; return
    what each said ("ok", or the error)."""
    import gloo_pair

    peer.send(("join", creation))
    try:
        gloo.join("g", "gloo", 0, 2, kv=kv or gloo_pair.StoreKV(port, f"{creation}/"), host="127.0.0.1",
                  attempt=creation, timeout_s=TS)  # fmt: skip
        ours = "ok"
    except Exception as exc:
        ours = f"{type(exc).__name__}: {exc}"
    assert peer.poll(30), "the peer's join did not end"
    return ours, peer.recv()


def test_a_fetch_from_an_old_group_that_fails_late_leaves_the_group_made_anew_alone(peer, port):
    # A fetch still under way when its group was destroyed failed after the name was
    # made anew, and marked the NEW group broken (by name): "a transfer failed".
    assert _join_with(peer, port, "old") == ("ok", "ok")
    answered = threading.Event()

    class Late:  # the producer's answer comes late, and is a failure
        async def request_send(self, request):
            while not answered.is_set():
                await asyncio.sleep(0.01)
            raise RuntimeError("the producer failed this send (test)")

    info = TransferInfo("0" * 24, (TensorSpec((4,), torch.float32, "cpu", 16),), gloo.GlooMeta("g", 1))
    fetch = _io.start(gloo.GlooTransport().receive(info, None, Late()))
    time.sleep(0.2)
    gloo.leave("g", "old")  # destroyed (this member left, the other too) ...
    peer.send(("leave", "old"))
    assert peer.recv() == "ok"
    try:
        assert _join_with(peer, port, "new") == ("ok", "ok")  # ... and made anew under its name
        answered.set()
        with pytest.raises(RuntimeError, match="the producer failed this send"):
            fetch.result(timeout=20)
        assert (gloo.groups.get("g").creation, gloo.groups.get("g").broken) == ("new", None)
    finally:
        gloo.leave("g")
        peer.send(("leave", "new"))
        peer.recv()


def test_a_join_that_completes_after_its_creation_was_given_up_is_dropped(peer, port):
    # The caller gave the creation up (Leave(name, creation)) while this member's join
    # was past its last read of the store: the join then completed and the abandoned
    # creation's group stayed, unknown to anyone.
    import gloo_pair

    fired = threading.Event()

    class GivenUpMidway(gloo_pair.StoreKV):
        def get(self, key):
            value = super().get(key)
            if value is not None and key == "k/0/1" and not fired.is_set():
                fired.set()  # the other member's address, its last read: the caller's undo comes now
                leave = threading.Thread(target=gloo.leave, args=("g", "given-up"))
                leave.start()
                leave.join()
            return value

    said, _ = _join_with(peer, port, "given-up", kv=GivenUpMidway(port, "given-up/"))
    try:
        assert fired.is_set()
        assert said == "CollectiveGroupError: the creation of group 'g' was given up while this member joined it"
        assert gloo.groups.get("g") is None
    finally:
        gloo.leave("g")
        peer.send(("leave", "given-up"))
        peer.recv()
