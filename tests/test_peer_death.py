"""One promise over every transport: a producer that dies gives PeerDiedError within seconds.

Never a hang, never BackendError or ObjectFreedError for a death, and the consumer keeps
serving. The producer dies before the fetch (killed, and its process gone, so its
connections are closed: Gloo then fails at once with "Connection closed by peer") or as
the fetch starts, on its node and from another node. Each kill takes a fresh producer;
the consumers (one a node) are shared by every test and must serve on.
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
from conftest import ON_NODE2, wait_until

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

N = 1 << 18  # 1 MiB of float32: over auto's inline limit


def _optional(name: str, module: str):
    if importlib.util.find_spec(module):
        return name
    return pytest.param(name, marks=pytest.mark.skip(f"{module} not installed"))


TRANSPORTS = ["auto", "shm", "object_store", "tcp", "gloo", _optional("nixl", "nixl"), _optional("ucxx", "ucxx")]


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
        self.fetched = 0

    async def total(self, value) -> float:  # the ref is fetched before the method runs
        return float(value["w"].sum())

    async def fetch_total(self, refs) -> float:
        return float((await rdt.fetch(refs[0]))["w"].sum())

    async def fetch_forever(self, refs) -> None:
        while True:  # fetch again and again until killed: the kill lands mid-fetch
            value = await rdt.fetch(refs[0])
            del value
            self.fetched += 1
            await asyncio.sleep(0)  # a fetch that never suspends (shm maps at once) would starve fetches()

    async def fetches(self) -> int:
        return self.fetched

    async def ping(self) -> str:
        return "pong"


def _ucx(transport: str) -> str:
    """Which UCX build the transport loads: one process takes nixl's or ucxx's, never both."""
    return "ucxx" if transport == "ucxx" else "nixl"


@pytest.fixture(scope="module")
def consumers(cluster):
    """consumer(where, transport): one a node (and UCX build), shared by every test here.

    A death must leave them serving: each test asks them to answer at its end.
    """
    made: dict[tuple[str, str], object] = {}

    def consumer(where: str, transport: str):
        key = (where, _ucx(transport))
        if key not in made:
            made[key] = (Consumer.options(**ON_NODE2) if where == "other node" else Consumer).remote()
        return made[key]

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


@pytest.mark.parametrize("where", ["same node", "other node"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_producer_killed_before_the_fetch_gives_peer_died_error(transport, where, consumers):
    if transport == "shm" and where == "other node":
        pytest.skip("shm serves its own node only")
    producer = Producer.remote()  # a fresh one for each kill; the consumers are shared
    consumer = consumers(where, transport)
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = make(producer, transport)
        assert ray.get(consumer.fetch_total.remote([ref]), timeout=60) == 2.0 * N  # it works while alive
        ref = make(producer, transport)
        ray.wait([ref], timeout=60)
        pid = ray.get(producer.pid.remote(), timeout=30)  # on this host: actors land on the head node
        ray.kill(producer)
        _wait_dead(pid)  # its sockets and endpoints are closed: the fetch meets a dead peer, not a dying one
        started = time.monotonic()
        with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
            ray.get(consumer.total.remote(ref), timeout=60)
        assert time.monotonic() - started < 15
        assert ray.get(consumer.ping.remote(), timeout=30) == "pong"  # the consumer serves on
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(producer)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_producer_killed_as_the_fetch_starts_gives_peer_died_error(transport, consumers):
    producer = Producer.remote()
    consumer = consumers("same node", transport)
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = make(producer, transport)
        ray.wait([ref], timeout=60)
        pid = ray.get(producer.pid.remote(), timeout=30)  # on this host: actors land on the head node
        # Stopped, the producer cannot serve the fetch before it dies: no race for the fetch to win.
        os.kill(pid, signal.SIGSTOP)
        try:
            pending = consumer.fetch_total.remote([ref])
            ray.wait([pending], timeout=0.5)  # the fetch starts meanwhile
        finally:
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        if transport == "shm":
            # shm reads the segment it maps, without the producer: a fetch that found it alive
            # may end whole after the death. It is then whole, or PeerDiedError: never a hang,
            # a torn value or another error.
            try:
                assert ray.get(pending, timeout=60) == 2.0 * N
            except rdt.PeerDiedError as e:
                assert re.search(r"died|disconnected", str(e)), str(e)
        else:
            with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
                ray.get(pending, timeout=60)
        assert time.monotonic() - started < 15
        assert ray.get(consumer.ping.remote(), timeout=30) == "pong"
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(producer)


@pytest.fixture(scope="module")
def survivors(cluster):
    """survivor(transport): a producer (one a UCX build) shared by the tests that kill its consumers.

    It must stay clean and serving: each test checks both.
    """
    made: dict[str, object] = {}

    def survivor(transport: str):
        if _ucx(transport) not in made:
            made[_ucx(transport)] = Producer.remote()
        return made[_ucx(transport)]

    yield survivor
    for actor in made.values():
        ray.kill(actor)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_consumer_killed_mid_fetch_leaves_the_producer_clean(transport, survivors):
    producer, consumer = survivors(transport), Consumer.remote()  # a fresh consumer for each kill
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = make(producer, transport, 1 << 23)  # 32 MiB: a fetch takes a while
        ray.wait([ref], timeout=60)
        consumer.fetch_forever.remote([ref])
        wait_until(lambda: ray.get(consumer.fetches.remote(), timeout=30) >= 2, 60)  # fetching, again and again
        ray.kill(consumer)
        del ref
        wait_until(lambda: ray.get(producer.held.remote(), timeout=30) == 0, 20, lambda: "objects held")
        assert ray.get(producer.held.remote(), timeout=30) == 0  # nothing kept for the dead consumer
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(consumer)


@pytest.mark.parametrize("transport", ["object_store", "tcp"])
def test_a_producer_that_ray_restarted_is_dead_for_its_objects(transport, consumers):
    """With max_restarts, Ray brings a crashed producer back as a new process, which holds
    none of the old one's objects: fetching them is a death (PeerDiedError, so callers
    retry elsewhere), not an ObjectFreedError or a TransferError about a live producer."""
    producer = Producer.options(max_restarts=1, **ON_NODE2).remote()
    consumer = consumers("same node", transport)
    try:
        ref = make(producer, transport)
        assert ray.get(consumer.fetch_total.remote([ref]), timeout=60) == 2.0 * N
        ref = make(producer, transport)
        ray.wait([ref], timeout=60)
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
        started = time.monotonic()
        with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
            ray.get(consumer.total.remote(ref), timeout=60)
        assert time.monotonic() - started < 15
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"  # the new one serves on
        assert ray.get(consumer.ping.remote(), timeout=30) == "pong"
    finally:
        ray.kill(producer)
