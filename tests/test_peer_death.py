"""One promise over every transport: a producer that dies gives PeerDiedError within seconds.

Never a hang, never BackendError or ObjectFreedError for a death, and the consumer keeps
serving. The producer dies as fetches start (stopped, fetches begun, then killed) and
before fetches (its process gone, so its connections are closed: Gloo then fails at once
with "Connection closed by peer"), on its node and from another node. One producer holds
objects over every transport and dies once for all of them (one a UCX build: a process
loads nixl's or ucxx's UCX, never both); each transport's fetch is checked on its own.
The consumers (one a node and UCX build) are shared by every test and must serve on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import time

import pytest
import ray
import torch
from conftest import ON_NODE2, UCXX_REFUSED, wait_until

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

N = 1 << 18  # 1 MiB of float32: over auto's inline limit

# Each UCX build's transports: a process loads nixl's UCX or ucxx's, never both.
BUILDS = {
    "nixl": ["auto", "shm", "object_store", "tcp", "gloo"] + (["nixl"] if importlib.util.find_spec("nixl") else []),
    "ucxx": ["ucxx"] if importlib.util.find_spec("ucxx") and not UCXX_REFUSED else [],
}
WHERE = ("same node", "other node")


def _build(name: str):
    why = UCXX_REFUSED if name == "ucxx" and UCXX_REFUSED else f"{name} not installed"
    return name if BUILDS[name] else pytest.param(name, marks=pytest.mark.skip(why))


@rdt.remote
class Producer:
    """One class for every transport: each call picks its own, make.options(tensor_transport=...)."""

    @rdt.method
    def make(self, n: int = N):
        return {"w": torch.full((n,), 2.0)}

    def held(self) -> int:
        return rdt.store_stats()["objects"]

    def ping(self) -> str:
        return "pong"

    def pid(self) -> int:
        return os.getpid()


def make(producer, transport: str, n: int = N):
    return producer.make.options(tensor_transport=transport).remote(n)


@rdt.remote
class Consumer:
    def __init__(self) -> None:
        self.fetched: dict[str, int] = {}

    async def total(self, value) -> float:  # the ref is fetched before the method runs
        return float(value["w"].sum())

    async def fetch_total(self, refs) -> float:
        return float((await rdt.fetch(refs[0]))["w"].sum())

    async def outcome(self, refs) -> str:
        """What a fetch of refs[0] ended in: the sum, or the error's type and message."""
        try:
            return repr(float((await rdt.fetch(refs[0]))["w"].sum()))
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    async def fetch_forever(self, refs, transport: str) -> None:
        while True:  # fetch again and again until killed: the kill lands mid-fetch
            value = await rdt.fetch(refs[0])
            del value
            self.fetched[transport] = self.fetched.get(transport, 0) + 1
            await asyncio.sleep(0)  # a fetch that never suspends (shm maps at once) would starve fetches()

    async def fetches(self) -> dict[str, int]:
        return self.fetched

    async def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def consumers(cluster):
    """consumer(where, build): one a node and UCX build, shared by every test here.

    A death must leave them serving: each test asks them to answer at its end.
    """
    made: dict[tuple[str, str], object] = {}

    def consumer(where: str, build: str):
        if (where, build) not in made:
            made[where, build] = (Consumer.options(**ON_NODE2) if where == "other node" else Consumer).remote()
        return made[where, build]

    yield consumer
    for actor in made.values():
        ray.kill(actor)


def _wait_dead(pid: int, timeout: float = 30) -> None:
    """Wait until the process is gone or a zombie: the kernel has closed its every socket and endpoint."""

    def dead() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return True

    wait_until(dead, timeout, lambda: f"the producer (pid {pid}) still runs")


def _died(outcome: str) -> bool:
    return outcome.startswith("PeerDiedError: ") and re.search(r"died|disconnected", outcome) is not None


@pytest.mark.parametrize("build", [_build(b) for b in BUILDS])
def test_a_producer_killed_as_fetches_start_and_before_fetches_gives_peer_died_error(build, consumers):
    transports = BUILDS[build]
    producer = Producer.remote()  # a fresh one, killed once for every transport; the consumers are shared
    near, far = consumers("same node", build), consumers("other node", build)
    group = rdt.create_collective_group([producer, near, far], backend="gloo") if "gloo" in transports else None
    try:
        for t in transports:  # it works while alive, on both nodes
            for c, where in ((near, "same node"), (far, "other node")):
                if t != "shm" or where == "same node":  # (shm serves its own node only)
                    assert ray.get(c.fetch_total.remote([make(producer, t)]), timeout=60) == 2.0 * N, (t, where)
        starting = {t: make(producer, t) for t in transports}
        before = {(t, w): make(producer, t) for t in transports for w in WHERE if t != "shm" or w == "same node"}
        ray.wait([*starting.values(), *before.values()], num_returns=len(starting) + len(before), timeout=60)
        pid = ray.get(producer.pid.remote(), timeout=30)  # on this host: actors land on the head node
        # Stopped, the producer cannot serve a fetch before it dies: no race for a fetch to win.
        os.kill(pid, signal.SIGSTOP)
        try:
            pending = {t: near.outcome.remote([ref]) for t, ref in starting.items()}
            ray.wait(list(pending.values()), timeout=0.5)  # the fetches start meanwhile
        finally:
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        for t, done in pending.items():
            outcome = ray.get(done, timeout=60)
            # shm reads the segment it maps, and nixl's READ on this host reads the producer's
            # memory through the kernel (UCX's CMA), both without the producer running: a
            # fetch that found it alive may end whole, even while it is stopped. It is then
            # whole, or PeerDiedError: never a hang, a torn value or another error.
            one_sided = t in ("shm", "nixl")
            assert _died(outcome) or (one_sided and outcome == repr(2.0 * N)), f"{t}, as the fetch started: {outcome}"
        assert time.monotonic() - started < 15, "the fetches begun before the kill took too long to end"
        _wait_dead(pid)  # its sockets and endpoints are closed: a fetch now meets a dead peer, not a dying one
        for (t, where), ref in before.items():
            started = time.monotonic()
            with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
                ray.get((near if where == "same node" else far).total.remote(ref), timeout=60)
            assert time.monotonic() - started < 15, f"{t} from the {where}"
        assert ray.get([near.ping.remote(), far.ping.remote()], timeout=30) == ["pong"] * 2  # they serve on
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(producer)


@pytest.fixture(scope="module")
def survivors(cluster):
    """survivor(build): a producer (one a UCX build) shared by the tests that kill its consumers.

    It must stay clean and serving: each test checks both.
    """
    made: dict[str, object] = {}

    def survivor(build: str):
        if build not in made:
            made[build] = Producer.remote()
        return made[build]

    yield survivor
    for actor in made.values():
        ray.kill(actor)


@pytest.mark.parametrize("build", [_build(b) for b in BUILDS])
def test_a_consumer_killed_mid_fetch_leaves_the_producer_clean(build, survivors):
    transports = BUILDS[build]
    producer, consumer = survivors(build), Consumer.remote()  # a fresh consumer, killed mid-fetch on every transport
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if "gloo" in transports else None
    try:
        refs = {t: make(producer, t, 1 << 23) for t in transports}  # 32 MiB each: a fetch takes a while
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=60)
        for t in refs:
            consumer.fetch_forever.remote([refs[t]], t)

        def fetching() -> bool:  # again and again, on every transport
            counts = ray.get(consumer.fetches.remote(), timeout=30)
            return all(counts.get(t, 0) >= 2 for t in transports)

        wait_until(fetching, 60, lambda: f"fetches so far: {ray.get(consumer.fetches.remote(), timeout=30)}")
        ray.kill(consumer)
        del refs
        wait_until(lambda: ray.get(producer.held.remote(), timeout=30) == 0, 20, lambda: "objects held")
        assert ray.get(producer.held.remote(), timeout=30) == 0  # nothing kept for the dead consumer
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(consumer)


def test_a_producer_that_ray_restarted_is_dead_for_its_objects(consumers):
    """With max_restarts, Ray brings a crashed producer back as a new process, which holds
    none of the old one's objects: fetching them is a death (PeerDiedError, so callers
    retry elsewhere), not an ObjectFreedError or a TransferError about a live producer."""
    transports = ("object_store", "tcp")
    producer = Producer.options(max_restarts=1, **ON_NODE2).remote()
    consumer = consumers("same node", "nixl")
    try:
        for t in transports:
            assert ray.get(consumer.fetch_total.remote([make(producer, t)]), timeout=60) == 2.0 * N, t
        refs = {t: make(producer, t) for t in transports}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=60)
        old = ray.get(producer.pid.remote(), timeout=30)
        ray.kill(producer, no_restart=False)  # Ray starts it again
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the new process serves (the old one may answer first)
            try:
                if ray.get(producer.pid.remote(), timeout=10) != old:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                time.sleep(0.2)
        else:
            pytest.fail("the producer did not come back")
        for t, ref in refs.items():
            started = time.monotonic()
            with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
                ray.get(consumer.total.remote(ref), timeout=60)
            assert time.monotonic() - started < 15, t
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"  # the new one serves on
        assert ray.get(consumer.ping.remote(), timeout=30) == "pong"
    finally:
        ray.kill(producer)
