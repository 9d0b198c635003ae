"""One two-host Ray cluster on this machine, shared by the whole session (by each
pytest-xdist worker, as `nox -s tests` runs it (RDT_TEST_WORKERS): each has a cluster and
hosts of its own, a module to one worker).

The second node runs on its own host: a network namespace joined to this one by a veth
pair, with its own hostname, boot id, /dev/shm and Ray temp dir (rdt_async.bench._hosts).
Where namespaces cannot be made (not root, not Linux), it is a second Ray node on this
host, and the session says so; RDT_TEST_ONE_HOST=1 asks for that.

RDT_TEST_TOPOLOGY picks how the hosts are joined (rdt_async.bench._hosts): `split` (the
default, the stricter: Ray's node IPs on a data network that is no host's default route,
nothing else routable between the hosts), `flat` (every host routes everything through
the head), `three` (split, with a third host that takes actors asking for "node3"), or
`split6` (split over IPv6: Ray's node IPs are IPv6 ones, and no IPv4 joins the hosts).

Ray is imported only when a test asks for the cluster: the transport contract suite
(tests/transports) runs without it, as on the GPU machine, where Ray is not installed.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import time
from collections.abc import Callable

import pytest

OBJECT_STORE_BYTES = 2 << 30  # each node's; memory is taken only as objects arrive
TOPOLOGY = os.environ.get("RDT_TEST_TOPOLOGY", "split")
if TOPOLOGY not in ("flat", "split", "three", "split6"):
    raise pytest.UsageError(f"RDT_TEST_TOPOLOGY={TOPOLOGY!r}: give flat, split, three or split6")


@pytest.fixture(scope="session")
def cluster():
    """Head node, and a second node that takes only actors asking for resource "node2".

    Actors land on the head node unless a test places them with `ON_NODE2`.
    """
    import ray
    from ray.cluster_utils import Cluster

    from rdt_async.bench._hosts import Hosts

    why = "RDT_TEST_ONE_HOST=1" if os.environ.get("RDT_TEST_ONE_HOST") == "1" else Hosts.unavailable()
    hosts = None if why else Hosts(TOPOLOGY if TOPOLOGY != "three" else "split")
    if hosts is not None and hosts.topology != "flat":
        # The split rig's data network is a Linux bridge, which UCX's TCP leaves out unless
        # told: rdt_async tells ucxx's (`transports/_ucx.settings`), not NIXL's, whose
        # devices it leaves alone. Set before any node starts, so every process has it.
        os.environ["UCX_TCP_BRIDGE_ENABLE"] = "y"
    # Ray declares a host that stops answering dead after ~10 s, not its default ~30-60 s
    # (test_partition cuts a host off and waits for that verdict).
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 10}
    # Ray's own metrics interval (10 s: test_metrics waits for its numbers); no dashboard
    # (its agents, which export metrics, still run).
    # A user's object store (Ray's default: 30% of memory), not Cluster's 150 MiB test
    # default: under that pressure Ray runs gc.collect() in every worker, holding each
    # one's GIL for 100-350 ms, which the loop-lag bounds then blame on the transfer.
    store = {"object_store_memory": OBJECT_STORE_BYTES}
    # No log monitor (it polls every worker's log files, ~1.5 CPU-s a minute per host and
    # more as files pile up; worker logs stay in the session's log directory), and the
    # agents' node report once a minute, not every 5 s (no test reads it): on 2 cores,
    # what the cluster spends idle, the tests wait for.
    quiet = {"include_log_monitor": False}
    quiet_host = ["--include-log-monitor=False"]  # (the same, for a host's `ray start`)
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
    head = {"num_cpus": 16, "resources": {"head": 1000}, "_system_config": health, "include_dashboard": False,
            **store, **quiet}
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    # Idle warm segments go after 1 s (not 10): the leak check below waits for them.
    os.environ["RDT_SHM_IDLE_S"] = "1"
    # Every node's raylet, and so every worker, inherits both from this process. A job's
    # runtime_env would say the same, but then each worker starts through Ray's
    # setup_worker.py: another `import ray`, ~0.8 CPU-s an actor, and none prestarted.
    os.environ["PYTHONPATH"] = path
    c = None
    try:  # (a start that fails still removes the hosts' namespaces and whatever started)
        c = Cluster(initialize_head=True, head_node_args=head if hosts is None else {**head, "node_ip_address": hosts.head_ip})
        ray.init(address=c.address)
        from rdt_async import _ray

        _ray.hand_node_ip()  # as a first produce would: tests that drive a transport alone listen where it does
        if hosts is None:
            print(f"\nnode2 runs on this host, not across hosts: {why}")
            c.add_node(num_cpus=0, resources={"node2": 1000}, **store)
            if TOPOLOGY == "three":
                c.add_node(num_cpus=0, resources={"node3": 1000}, **store)
            c.wait_for_nodes()
        else:
            hosts.add("node2", c.address, {"node2": 1000}, start_args=quiet_host)
            if TOPOLOGY == "three":
                hosts.add("node3", c.address, {"node3": 1000}, start_args=quiet_host)
        c.hosts = hosts
        # What the driver holds by now (torch, Ray, the collected test modules: ~220k objects)
        # goes to the permanent generation. A full collection walks every object, holding
        # the GIL (~130 ms on an idle core here): Ray's PythonGCThread runs one whenever
        # Ray asks every worker for one, and an async test's loop waits through it.
        gc.freeze()
        yield c
    finally:
        try:
            settle_left_segments()  # (the last test's, while the hosts still run)
        finally:
            ray.shutdown()
        if c is not None:
            c.shutdown()
        if hosts is not None:
            hosts.close()


@pytest.fixture(scope="session")
def sync_producer(cluster):
    """A helpers.SyncProducer on the head host, shared by the modules that use it as it is
    (each actor is a process that imports Ray and torch: ~1.7 CPU-s here). A test frees what it made with
    it; one that kills its producer, or needs one elsewhere, makes its own."""
    import ray
    from helpers import SyncProducer

    p = SyncProducer.remote()
    ray.get(p.pid.remote())  # up before a first test's deadlines start
    yield p
    ray.kill(p)


@pytest.fixture(scope="session")
def async_consumer(cluster):
    """A helpers.AsyncConsumer on the head host, shared as sync_producer is."""
    import ray
    from helpers import AsyncConsumer

    c = AsyncConsumer.remote()
    ray.get(c.ping.remote())
    yield c
    ray.kill(c)


@pytest.fixture
def ray_session(cluster, request):
    """The shared cluster; checks that the test leaves no shared-memory segment behind.

    A segment a test leaves may be an idle warm one (it goes after RDT_SHM_IDLE_S, 1 s
    here), so the check is settled at the next test's end, or the session's, while that
    test runs: a segment still there 15 s after its test ended fails the check, naming the
    test that left it (before, every such test waited ~1 s at its end: ~60 s a run).
    """
    raylets = {
        info.process.pid
        for node in cluster.list_all_nodes()
        for info in node.all_processes.get("raylet", [])
    }
    shm_dirs = ["/dev/shm"]
    if cluster.hosts is not None:
        for node in cluster.hosts.nodes():
            raylets.update(node.raylet_pids())
            shm_dirs.append(node.shm_dir())

    def ours() -> set[str]:  # this session's segments, and any whose producer is dead
        return {s for d in shm_dirs for s in _rdt_segments(d) if _owned_by(int(s.split("-")[1]), raylets)}

    before = ours()
    yield cluster
    settle_left_segments()
    left = ours() - before
    if left:  # most tests leave none: no full collection (0.1-0.3 s here) for them
        _left.append((request.node.nodeid, time.monotonic() + 15, lambda: ours() & left))


# What a test's segments the check has yet to see go: (test, deadline, those still there).
_left: list[tuple[str, float, Callable[[], set[str]]]] = []


def settle_left_segments() -> None:
    """Wait for the segments earlier tests left to go, each until its test's deadline."""
    while _left:
        _settle(*_left.pop(0))


def _settle(test: str, deadline: float, still: Callable[[], set[str]]) -> None:
    _wait_until(lambda: not still(), max(0.0, deadline - time.monotonic()), lambda: f"leaked segments, left by {test}: {still()}")


def _rdt_segments(where: str = "/dev/shm") -> set[str]:
    try:
        names = os.listdir(where)
    except FileNotFoundError:  # a host a test removed: its /dev/shm went with it
        return set()
    return {n for n in names if n.startswith("rdt-")}


def _owned_by(pid: int, raylets: set[int]) -> bool:
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return True  # dead producer: its guardian should have swept it
    return ppid in raylets


def _wait_until(cond, timeout: float, what=lambda: "condition"):
    """Poll `cond` every 50 ms for `timeout` s. A ref held only by a cycle goes with a full
    collection, which costs 0.1-0.3 s of this process's CPU: one at once, then one a second."""
    deadline = time.monotonic() + timeout
    collected = float("-inf")  # (monotonic's zero is arbitrary)
    while not cond():
        now = time.monotonic()
        if now - collected >= 1.0:
            gc.collect()
            collected = now
            if cond():
                return
        if now > deadline:
            raise AssertionError(f"not true after {timeout} s: {what()}")
        time.sleep(0.05)


# RDT_TEST_TOPOLOGY=split6: Ray's node IPs are IPv6 ones, which ucxx refuses (its listener
# binds IPv4 only): the modules that run ucxx on the cluster leave it out, saying this.
UCXX_REFUSED = "ucxx refuses IPv6 node IPs (RDT_TEST_TOPOLOGY=split6; test_network checks how)" if TOPOLOGY == "split6" else None
ON_NODE2 = {"num_cpus": 0, "resources": {"node2": 1}}
ON_NODE3 = {"num_cpus": 0, "resources": {"node3": 1}}  # RDT_TEST_TOPOLOGY=three only
wait_until = _wait_until
rdt_segments = _rdt_segments


# -- every async test: its event loop must stay free -----------------------------------------

# The longest an async test's loop may go without running a 5 ms sleeper on time. Work
# that blocks it (a copy, a native wait on the loop's thread) shows here on any test;
# a test that means to block marks itself `@pytest.mark.allow_stall`.
MAX_STALL_S = float(os.environ.get("RDT_TEST_MAX_STALL_S", "0.1"))


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_stall: the test blocks its event loop on purpose")


# The modules that take longest (seconds of one worker, summed from `--durations=0` of a
# full run), run first: `nox -s tests` hands each xdist worker the next module as it frees
# (`--dist loadfile --no-loadscope-reorder`), so the short ones fill in at the end. In
# xdist's own order (most tests first) the longest modules, which hold few tests, came
# last, and one worker ran them while the other idled.
LONGEST_FIRST = (
    "test_firewall.py", "test_nixl.py", "test_contract.py", "test_partition.py", "test_publish.py", "test_ucxx.py",
    "test_relay.py", "test_gloo.py", "test_without_optional.py", "test_peer_death.py", "test_custom_transport.py",
    "test_network.py", "test_churn.py", "test_tcp.py", "test_ipv6.py", "test_concurrency.py", "test_collectives.py",
    "test_three_hosts.py", "test_ray_client.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest as collected)
    for item in items:
        fn = getattr(item, "obj", None)
        if inspect.iscoroutinefunction(fn) and item.get_closest_marker("allow_stall") is None:
            item.obj = _stall_guarded(fn)


def _stall_guarded(fn):
    @functools.wraps(fn)
    async def guarded(*args, **kwargs):
        from probes import LagProbe

        probe = LagProbe()
        probe.start()
        try:
            result = await fn(*args, **kwargs)
        finally:
            stall = await probe.stop()
        assert stall < MAX_STALL_S, (
            f"the test's event loop stalled {stall * 1000:.0f} ms (limit {MAX_STALL_S * 1000:.0f} ms, "
            f"RDT_TEST_MAX_STALL_S): something blocked it. {probe.report()}"
        )
        return result

    return guarded
