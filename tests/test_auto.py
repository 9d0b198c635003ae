"""`auto`'s cost model (transports/_auto.py): candidates, choices, their reasons, overrides."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rdt_async.transports import _auto, _registry
from rdt_async.transports._auto import Cost, Facts
from rdt_async.transports._base import Transport
from rdt_async.transports.nixl import NixlTransport
from rdt_async.transports.object_store import ObjectStoreTransport

MiB = 1 << 20


def facts(nbytes=64 * MiB, *, same_node=False, gpu=False, prepared=("shm", "nixl"), loads=None, group=None):
    # What the consumer states from the transports' declared capabilities (_choose.choose_transport).
    prepared = frozenset(prepared)
    loads = prepared if loads is None else frozenset(loads)
    return Facts(nbytes, gpu, same_node, prepared, loads, group, prepared & {"shm", "cuda_ipc"}, prepared & {"inline"})


def test_small_objects_take_the_bytes_that_came_with_the_ref():
    choice = _auto.choose(facts(4096, prepared=("inline",)))
    assert (choice.transport, choice.why, dict(choice.estimates)) == ("inline", "small: the bytes came with the ref", {})


def test_candidates_are_only_what_both_ends_can_use():
    assert _auto.candidates(facts(same_node=True)) == ["shm", "nixl", "object_store"]
    assert _auto.candidates(facts(same_node=False)) == ["nixl", "object_store"]  # shm is one host only
    assert _auto.candidates(facts(loads=())) == ["object_store"]  # nixl prepared, not loadable here
    # A node-local path of someone else's is one host only too: capabilities, not names.
    mine = Facts(MiB, False, False, frozenset({"mine", "tcp"}), frozenset({"mine", "tcp"}), None, frozenset({"mine"}))
    assert _auto.candidates(mine) == ["tcp", "object_store"]
    assert _auto.candidates(dataclasses.replace(mine, same_node=True)) == ["mine", "tcp", "object_store"]
    assert _auto.candidates(facts(prepared=("shm",), group="gloo")) == ["gloo", "object_store"]
    assert _auto.candidates(facts(gpu=True, same_node=True, prepared=("cuda_ipc",), loads=())) == ["object_store"]


def test_the_cheapest_candidate_wins_and_the_reason_ranks_them():
    costs = {"nixl/hosts": Cost(0.001, 0.5), "gloo/hosts": Cost(0.005, 2.0), "object_store/hosts": Cost(0.002, 0.25)}
    big = _auto.choose(facts(256 * MiB, group="gloo"), costs)
    assert big.transport == "gloo"
    assert big.estimates == pytest.approx({"nixl": 0.501, "gloo": 0.13, "object_store": 1.002})
    assert big.why == "256 MiB CPU from another node: gloo 130 ms < nixl 501 ms < object_store 1e+03 ms"
    small = _auto.choose(facts(64 << 10, group="gloo"), costs)  # latency decides
    assert small.transport == "nixl"
    assert small.as_dict()["estimates_ms"] == {"nixl": 1.122, "gloo": 5.031, "object_store": 2.244}


def test_a_path_with_no_known_cost_is_not_guessed():
    choice = _auto.choose(facts(), {"object_store/hosts": Cost(0.01, 1.0)})
    assert choice.transport == "object_store" and set(choice.estimates) == {"object_store"}
    assert _auto.choose(facts(), {}).transport == "object_store"


def test_measured_costs_from_a_file_replace_the_defaults(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cpu": {"object_store/hosts": [0.0, 100.0]}}))
    monkeypatch.setenv("RDT_AUTO_COSTS", str(path))
    table = _auto.cost_table(gpu=False)
    assert table["object_store/hosts"] == Cost(0.0, 100.0)
    assert table["nixl/hosts"] == NixlTransport.auto_costs["cpu/hosts"]  # the rest stay
    assert _auto.choose(facts()).transport == "object_store"
    assert _auto.cost_table(gpu=True)["object_store/hosts"] == ObjectStoreTransport.auto_costs["gpu/hosts"]  # no "gpu" part


def test_an_unreadable_cost_file_names_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    monkeypatch.setenv("RDT_AUTO_COSTS", str(path))
    with pytest.raises(ValueError, match=r"RDT_AUTO_COSTS=.*bad\.json.*unset RDT_AUTO_COSTS.*--write-costs FILE"):
        _auto.choose(facts())


@pytest.mark.parametrize("cost", ["[0.001, 0]", "[0.001, -2.0]", "[-0.5, 1.0]", "[NaN, 1.0]", '[0.001, "inf"]', "[Infinity, 1.0]"])
def test_a_cost_file_whose_latency_or_bandwidth_is_no_cost_names_the_entry_and_the_fix(tmp_path, monkeypatch, cost):
    # (a bandwidth of 0 raised ZeroDivisionError at every auto choice; a negative one won them all)
    path = tmp_path / "costs.json"
    path.write_text(f'{{"cpu": {{"object_store/hosts": {cost}}}}}')
    monkeypatch.setenv("RDT_AUTO_COSTS", str(path))
    with pytest.raises(ValueError, match=r"RDT_AUTO_COSTS=.*costs\.json.*: its cpu cost 'object_store/hosts' is \[.*\]: give \[latency_s, GiB/s\], a latency of 0 or more and a bandwidth above 0, both finite; unset RDT_AUTO_COSTS"):
        _auto.choose(facts())


@pytest.mark.parametrize("text", ["{not json", '{"cpu": {"tcp/hosts": [0.001]}}', '{"cpu": ["tcp/hosts"]}', "[]"])
def test_the_bench_refuses_to_merge_costs_into_a_file_that_is_not_one_before_it_runs(tmp_path, text):
    from rdt_async.bench._e2e import check_costs_file

    path = tmp_path / "costs.json"
    path.write_text(text)
    with pytest.raises(SystemExit, match=r"--write-costs .*costs\.json: cannot read costs from it .*: remove it, or name another file"):
        check_costs_file(str(path))
    path.write_text('{"cpu": {"tcp/hosts": [0.001, 1.5]}}')
    check_costs_file(str(path))  # a good one is merged into
    check_costs_file(str(tmp_path / "new.json"))  # and a new one written


def test_fit_recovers_latency_and_bandwidth():
    points = [(n, 0.003 + n / (2.0 * _auto.GiB)) for n in (4096, MiB, 64 * MiB, 256 * MiB)]
    cost = _auto.fit(points)
    assert cost is not None
    assert cost.latency_s == pytest.approx(0.003, abs=1e-9) and cost.gib_s == pytest.approx(2.0)
    assert _auto.fit([(MiB, 0.1), (MiB, 0.2)]) is None  # one size: no slope
    assert _auto.fit([(MiB, 0.2), (2 * MiB, 0.1)]) is None  # faster when bigger: no model


def test_loadability_is_asked_only_of_a_winner_that_needs_it():
    asked = []

    def loads(name):
        asked.append(name)
        return name != "nixl"  # prepared by the producer, but this process cannot load it

    same_node = facts(same_node=True)
    assert _auto.choose_checked(same_node, loads).transport == "shm" and asked == ["shm"]  # not nixl: an import
    other = _auto.choose_checked(facts(), loads)
    assert (other.transport, asked) == ("object_store", ["shm", "nixl"])
    assert set(other.estimates) == {"object_store"}


def test_the_bench_refuses_unknown_paths_before_it_runs():
    from rdt_async.bench._e2e import check_paths

    assert check_paths(" Rdt auto , ray object store  zero-copy,") == ["rdt auto", "ray object store zero-copy"]
    assert check_paths("") is None
    with pytest.raises(SystemExit, match=r"--e2e-paths: unknown 'ray objectstore'; the paths are: rdt auto, rdt auto into=, rdt shm"):
        check_paths("rdt auto,ray objectstore")


def test_the_bench_refuses_unknown_shapes_before_it_runs():
    from rdt_async.bench._e2e import SHAPES, check_shapes

    assert SHAPES == ("kept", "plain", "fresh")
    assert check_shapes(" Plain, fresh,plain") == ("plain", "fresh")
    assert check_shapes("") == SHAPES
    with pytest.raises(SystemExit, match=r"--e2e-shapes: unknown 'shared'; the shapes are: kept, plain, fresh"):
        check_shapes("plain,shared")


def test_the_benchs_producer_shapes_keep_a_shared_and_a_plain_tensor_and_make_fresh_ones():
    from rdt_async.bench._e2e import _value

    kept: dict = {}
    shared, plain, fresh = (_value(kept, 1000, s) for s in ("kept", "plain", "fresh"))
    assert shared.untyped_storage().is_shared() and not plain.untyped_storage().is_shared()
    assert not fresh.untyped_storage().is_shared() and fresh.sum().item() == plain.sum().item() == 1000.0
    assert _value(kept, 1000, "kept") is shared and _value(kept, 1000, "plain") is plain  # the same each call
    assert _value(kept, 1000, "fresh") is not fresh and len(kept) == 2


def test_the_benchs_physical_limit_reads_every_byte_and_leaves_no_file(ray_session):
    import glob

    from rdt_async.bench._e2e import LIMIT, _make_path, unavailable

    path = _make_path(LIMIT, 2)
    try:
        for shape in ("kept", "plain", "fresh", "kept", "plain"):
            took, stall = path.one_pass(1 << 18, shape, k=2)  # one_pass checks each consumer's sum
            assert took > 0 and stall is not None
        parts = path.parts(1 << 18, "fresh")
        assert parts is not None and set(parts) == {"calls_s", "fetch_s", "read_s"}
        assert len(glob.glob("/dev/shm/rdtbench-limit-*")) == 1  # one file a size, shared by all
    finally:
        path.close()
    assert glob.glob("/dev/shm/rdtbench-limit-*") == []
    assert unavailable(LIMIT, hosts=1) is None
    assert unavailable(LIMIT, hosts=2) == "one host only"  # across hosts the limit is the network's: a row saying so


def test_the_benchs_into_path_lands_every_value_in_the_consumers_own_tensor(ray_session):
    from rdt_async.bench._e2e import INTO, _make_path, check_paths, unavailable

    assert check_paths(f"{INTO.upper()}, rdt auto") == [INTO, "rdt auto"] and unavailable(INTO, hosts=2) is None
    path = _make_path(INTO, 2)
    try:
        for n, shape in ((1 << 18, "kept"), (1 << 18, "fresh"), (1 << 10, "plain"), (1 << 18, "kept")):
            took, stall = path.one_pass(n, shape, k=2)  # each consumer's sum checked; a copy elsewhere raises
            assert took > 0 and stall is not None
        parts = path.parts(1 << 18, "kept")
        assert parts is not None and set(parts) == {"calls_s", "fetch_s", "read_s"}
    finally:
        path.close()


def test_a_fetch_of_a_small_object_takes_its_bytes_without_the_cost_model(monkeypatch):
    """`choose_transport`'s shortcut for bytes that came with the ref says what `choose` says,
    and steps aside where the fetch has already left a path out."""
    import torch

    from rdt_async import _choose
    from rdt_async._fetched import fetched
    from rdt_async._object import Process, RDTObject
    from rdt_async.transports._base import TensorSpec
    from rdt_async.transports.inline import encode

    t = torch.arange(16.0)
    specs = (TensorSpec((16,), torch.float32, "cpu", 64),)
    meta = {"inline": (encode(t),), "groups": {}}
    obj = RDTObject("ab" * 12, Process("a" * 56, "1:00"), "auto", specs, None, meta, {}, None)
    monkeypatch.setattr(_auto, "choose_remembered", lambda *a: pytest.fail("the cost model ran"))
    assert _choose.choose_transport(obj, "b" * 56) == ("inline", meta["inline"])
    assert fetched.stats()["auto"][-1] == {"obj_id": "ab" * 12, **_auto.choose(facts(64, prepared=("inline",))).as_dict()}
    monkeypatch.undo()
    # Left out by this fetch (it failed there): the cost model picks among the rest.
    assert _choose.choose_transport(obj, "b" * 56, without=frozenset({"inline"})) == ("object_store", None)


def test_the_built_ins_cost_table_is_what_each_declares_and_nothing_unmeasured_for_cpu():
    cpu = _auto.cost_table(False, _registry.BUILTIN)  # (other tests of the session register theirs)
    assert set(cpu) == {
        "shm/node", "tcp/node", "tcp/hosts", "nixl/node", "nixl/hosts",
        "gloo/node", "gloo/hosts", "object_store/node", "object_store/hosts",
    }  # nothing for ucxx (auto never takes it), inline (its bytes come with the ref) or nccl (GPU only)
    gpu = _auto.cost_table(True, _registry.BUILTIN)
    assert set(gpu) == {
        "cuda_ipc/node", "nixl/node", "nixl/hosts", "nccl/node", "nccl/hosts", "object_store/node", "object_store/hosts",
    }
    assert _auto.cost_table(False, ["shm", "no-such"]) == {"shm/node": Cost(0.0039, 2.30)}


def plan_names(devices=("cpu",), nbytes=64 * MiB, several=False, *, not_here=(), asked=None, more=()):
    def exports(cls):
        if asked is not None:
            asked.append(cls.name)
        return cls.name not in not_here

    classes = [*map(_registry.transport_class, _registry.BUILTIN), *more]  # (not other tests' registrations)
    return [c.name for c in _auto.plan(classes, set(devices), nbytes, several, exports)]


@pytest.mark.parametrize(
    "devices, nbytes, several, not_here, expected",
    [
        (("cpu",), 4096, True, (), ["inline"]),  # small: the bytes ride in the ref, alone
        (("cpu",), 64 << 10, False, (), ["inline"]),  # (inline's auto_max_bytes)
        (("cpu",), (64 << 10) + 1, False, (), ["shm"]),
        (("cpu",), MiB, False, (), ["shm"]),  # one node: shared memory only
        (("cpu",), 64 * MiB, True, (), ["shm", "tcp"]),  # other nodes: tcp (cheaper than nixl over TCP)
        # No /dev/shm here: this node's next cheapest (nixl's CMA reads), and tcp for the others.
        (("cpu",), 64 * MiB, True, ("shm",), ["nixl", "tcp"]),
        (("cpu",), 64 * MiB, False, ("shm", "nixl"), ["tcp"]),
        (("cuda",), 64 * MiB, False, (), ["cuda_ipc"]),
        (("cuda",), 64 * MiB, True, (), ["cuda_ipc", "nixl"]),
        (("cuda",), 64 * MiB, False, ("cuda_ipc",), ["nixl"]),  # memory CUDA IPC cannot export
        (("cuda",), 64 * MiB, True, ("nixl",), ["cuda_ipc"]),  # other nodes: the object store
        (("cuda",), 64 * MiB, True, ("nixl", "cuda_ipc"), []),
        (("cpu", "cuda"), 64 * MiB, True, (), ["nixl"]),  # mixed devices: what moves both
    ],
)
def test_what_auto_prepares_an_object_for_is_asked_of_the_transports(devices, nbytes, several, not_here, expected):
    assert plan_names(devices, nbytes, several, not_here=not_here) == expected


def test_a_faster_network_for_nixl_prepares_it_beside_tcp_and_nixl_is_not_asked_otherwise(tmp_path, monkeypatch):
    asked = []
    assert plan_names(several=True, asked=asked) == ["shm", "tcp"]
    assert "nixl" not in asked  # asking whether NIXL exports may load it (~0.3 s with the GIL)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cpu": {"nixl/hosts": [0.006, 10.0]}}))  # an RDMA network's, measured
    monkeypatch.setenv("RDT_AUTO_COSTS", str(path))
    assert plan_names(several=True) == ["shm", "nixl", "tcp"]  # tcp: free to prepare, the fallback
    assert plan_names(nbytes=MiB, several=True) == ["shm", "tcp"]  # where tcp is still faster
    assert plan_names(several=False) == ["shm"]


class Fast(Transport):
    """A user's node-local transport declaring shm's powers and a lower cost."""

    name = "fast-local"
    devices = ("cpu",)
    reach = "node"
    auto_prepares = True
    auto_costs = {"cpu/node": Cost(0.0001, 100.0)}

    async def receive(self, info, buffers, channel):
        raise NotImplementedError


def test_a_transport_of_yours_that_declares_shms_powers_takes_its_place(monkeypatch):
    monkeypatch.setitem(_registry._classes, "fast-local", Fast)
    assert plan_names(several=True, more=[Fast]) == ["fast-local", "tcp"]  # not shm: it costs less on this node
    assert plan_names(several=True, more=[Fast], not_here=("fast-local",)) == ["shm", "tcp"]
    f = Facts(64 * MiB, False, True, frozenset({"fast-local", "tcp"}), frozenset({"fast-local", "tcp"}),
              node_local=frozenset({"fast-local"}))
    assert _auto.choose(f).transport == "fast-local"  # and the consumer takes it, by its declared cost
    assert _auto.choose(dataclasses.replace(f, same_node=False)).transport == "tcp"  # (reach: one node)
    assert _auto.cost_table(True, ["fast-local"]) == {}  # no GPU cost: never taken for GPU tensors


def test_only_a_name_some_process_may_have_registered_lists_the_clusters_registrations(monkeypatch):
    # A producing call asks `known_class("auto")` each time (check_grouped): no GCS call for it,
    # nor for a built-in's name or a malformed one from a crafted ref; an unknown valid name may.
    listed = []
    monkeypatch.setattr(_registry, "_lister", lambda: listed.append(1) or [])
    monkeypatch.setattr(_registry, "_listed_at", 0.0)  # (long ago)
    assert _registry.known_class("shm").name == "shm"
    for name in ("auto", "AUTO", "x" * 300, "../etc", "a:b"):
        assert _registry.known_class(name) is None
    assert listed == []
    assert _registry.known_class("someones-own") is None
    assert listed == [1]


@pytest.fixture
def avoided(monkeypatch):
    """A fresh table of the paths `auto` leaves out, for `_choose` too."""
    from rdt_async import _avoid, _choose, _transfer

    table = _avoid.Avoided()
    for module in (_avoid, _choose, _transfer):
        monkeypatch.setattr(module, "avoided", table)
    return table


def _unreachable(why: str = "no route", lasting: bool = True):
    """A fetch's error where its transport could not reach the producer (as tcp raises it)."""
    from rdt_async._errors import TransferError
    from rdt_async.transports._base import Unreachable

    exc = TransferError(f"tcp fetch failed: {why}")
    exc.__cause__ = Unreachable(why, lasting=lasting)
    return exc


class _Producer:
    label = "actor 0123abcd"

    def __init__(self, node: str) -> None:
        self.node_id = node


def test_a_path_that_could_not_reach_a_host_is_left_out_for_that_host_only(avoided):
    """auto leaves tcp out for a node's objects at the host it could not reach (a connect
    with no answer costs every producer there CONNECT_S): a producer of that node with its
    own address (its own RDT_TCP_HOST), or a crafted ref naming a bogus one, takes the path
    away from no other object of the node; a refused connect leaves nothing out."""
    import torch

    from rdt_async import _choose
    from rdt_async._object import Process, RDTObject
    from rdt_async.transports._base import TensorSpec
    from rdt_async.transports.tcp import TcpMeta, TcpTransport

    node = "a" * 56
    specs = (TensorSpec((1 << 20,), torch.float32, "cpu", 4 << 20),)

    def obj(host: str, port: int = 40000) -> RDTObject:
        meta = {"tcp": TcpMeta(host, port, bytes(16)), "object_store": None, "groups": {}}
        return RDTObject("ab" * 12, Process(node, "1:00"), "auto", specs, None, meta, {}, None)

    bogus, honest, closed = obj("10.9.9.9"), obj("10.0.0.2"), obj("10.0.0.2", 40001)
    assert TcpTransport.address(closed.meta["tcp"]) == "10.0.0.2"
    assert TcpTransport.address(TcpMeta("::ffff:10.0.0.2", 40001, bytes(16))) == "10.0.0.2"  # one spelling
    assert TcpTransport.address(TcpMeta("FD00::5", 7, bytes(16))) == "fd00::5"
    avoided.note(closed.producer, "tcp", _unreachable("refused", lasting=False), "refused", TcpTransport.address(closed.meta["tcp"]))
    assert _choose._left_out(closed) == _choose._left_out(honest) == frozenset()  # the host answered
    avoided.note(bogus.producer, "tcp", _unreachable(), "no route", "10.9.9.9")
    assert _choose._left_out(bogus) == {"tcp"}
    assert _choose._left_out(honest) == frozenset()  # another host of the node: its listener's own
    assert _choose.choose_transport(honest, "b" * 56)[0] == "tcp"
    assert _choose.choose_transport(bogus, "b" * 56)[0] == "object_store"
    avoided.note(closed.producer, "tcp", _unreachable(), "no answer", TcpTransport.address(closed.meta["tcp"]))
    assert _choose._left_out(honest) == {"tcp"}  # no answer from its host: every port of it
    # A path with no address (the node's): every object of that node.
    avoided.clear()
    avoided.note(honest.producer, "tcp", _unreachable(), "no route")
    assert _choose._left_out(bogus) == {"tcp"}

    class Failing:
        @classmethod
        def address(cls, meta):
            raise RuntimeError("a transport of yours that cannot say")

    assert _choose.address_of(Failing, None) is None


def test_a_listener_that_is_not_the_refs_producer_and_a_transport_that_cannot_serve_leave_nothing_out(avoided, caplog):
    """A tcp greeting of another token (a stale or crafted ref naming a live producer's
    listener) and a TransportUnavailableError send that fetch over the next path; the log
    says so, and nothing is left out of the node's later fetches."""
    from rdt_async import TransportUnavailableError
    from rdt_async._avoid import AVOID_S

    node = "a" * 56
    caplog.set_level("WARNING", logger="rdt_async")
    avoided.note(_Producer(node), "tcp", _unreachable("its greeting is not the one", lasting=False), "not ours", "10.0.0.2:40000")
    avoided.note(_Producer(node), "mine", TransportUnavailableError("no room"), "no room")
    assert not avoided.any() and avoided.of(node) == frozenset()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"rdt_async: auto could not use {t} with actor 0123abcd (node aaaaaaaaaaaa): {why}; fetching this object over "
        f"the next path; it takes {t} again for the next object (said once per node and path)"
        for t, why in (("tcp", "not ours"), ("mine", "no room"))
    ]
    avoided.note(_Producer(node), "tcp", _unreachable(), "refused", "10.0.0.2:40001")
    assert caplog.records[-1].getMessage().endswith(
        f"; fetching this object over the next path; auto leaves tcp out for that node's objects at 10.0.0.2:40001 for {AVOID_S:g} s"
    )
    assert avoided.of(node) == {("tcp", "10.0.0.2:40001")}


def test_the_paths_left_out_stay_cheap_to_ask_however_many_nodes_refs_name(avoided, monkeypatch):
    """Crafted refs naming many nodes: a fetch asks its own node's entries (no walk of all),
    ended ones go, and the fallbacks remembered as logged are the last WARNED."""
    import time

    from rdt_async import TransportUnavailableError, _avoid

    monkeypatch.setattr(_avoid, "log", type("Quiet", (), {"warning": staticmethod(lambda *a, **k: None)}))
    exc = _unreachable()
    for i in range(50_000):
        avoided.note(_Producer(f"{i:056x}"), "tcp", exc, "no route", f"10.0.{i >> 8 & 255}.{i & 255}:1")
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert avoided.of("c" * 56) == frozenset()
        took.append(time.perf_counter() - t0)
    assert min(took) < 1e-3, took  # (a walk of every entry took ~5 ms)
    assert avoided.of(f"{7:056x}") == {("tcp", "10.0.0.7:1")}
    later = time.monotonic() + _avoid.AVOID_S + 1
    with monkeypatch.context() as m:
        m.setattr(_avoid, "time", type("Later", (), {"monotonic": staticmethod(lambda: later)}))
        assert avoided.of(f"{7:056x}") == frozenset() and not avoided.any()  # ended: gone, every node's
    for i in range(_avoid.WARNED + 50):
        avoided.note(_Producer(f"{i:056x}"), "tcp", TransportUnavailableError("no room"), "no room")
    assert len(avoided._warned) == _avoid.WARNED


def test_nixl_reads_that_stall_from_one_producer_leave_nixl_out_for_that_producer_only(avoided):
    """nixl's address is the producer's agent (name and connection metadata): READs that
    stall from one producer, or from a ref naming a live agent with other connection
    metadata, take nixl away from no other producer of the node."""
    import torch

    from rdt_async import _choose
    from rdt_async._object import Process, RDTObject
    from rdt_async.transports._base import TensorSpec
    from rdt_async.transports.nixl._meta import NixlMeta

    node = "a" * 56
    specs = (TensorSpec((1 << 20,), torch.float32, "cpu", 4 << 20),)

    def obj(agent: str, conn: bytes, pid: int) -> RDTObject:
        meta = {"nixl": NixlMeta(agent, conn, (), (None,), 0, 1, pid, "host-a"), "object_store": None}
        return RDTObject("ab" * 12, Process(node, f"{pid}:00"), "auto", specs, None, meta, {}, None)

    stalled, other = obj("rdt-host-a-11-0a0a0a0a", b"conn-11", 11), obj("rdt-host-a-12-0b0b0b0b", b"conn-12", 12)
    crafted = obj("rdt-host-a-12-0b0b0b0b", b"not its conn", 12)
    address = NixlTransport.address(stalled.meta["nixl"])
    assert address is not None and address.startswith("rdt-host-a-11-0a0a0a0a/")
    assert NixlTransport.address(crafted.meta["nixl"]) != NixlTransport.address(other.meta["nixl"])
    assert NixlTransport.address("crafted meta") is None
    for ref in (stalled, crafted):
        avoided.note(ref.producer, "nixl", _unreachable("nixl READs stall"), "stall", _choose.address_of(NixlTransport, ref.meta["nixl"]))
    assert _choose._left_out(stalled) == {"nixl"}  # its other objects: the same agent
    assert _choose._left_out(other) == frozenset()
