"""One promise over every transport: a producer that dies gives PeerDiedError within seconds.

Never a hang, never BackendError or ObjectFreedError for a death, and the consumer keeps
serving. The producer dies before the fetch (killed, then given time for its connections
to close: Gloo then fails at once with "Connection closed by peer") or as the fetch
starts, on its node and from another node.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import time

import pytest
import ray
import torch
from conftest import ON_NODE2

import rdt_async as rdt

pytestmark = pytest.mark.usefixtures("ray_session")

N = 1 << 18  # 1 MiB of float32: over auto's inline limit


def _optional(name: str, module: str):
    if importlib.util.find_spec(module):
        return name
    return pytest.param(name, marks=pytest.mark.skip(f"{module} not installed"))


TRANSPORTS = ["auto", "shm", "object_store", "tcp", "gloo", _optional("nixl", "nixl"), _optional("ucxx", "ucxx")]


def _producer(transport: str):
    @rdt.remote
    class Producer:
        @rdt.method(tensor_transport=transport)
        def make(self):
            return {"w": torch.full((N,), 2.0)}

        def ping(self) -> str:
            return "pong"

        def pid(self) -> int:
            return os.getpid()

    return Producer


@rdt.remote
class Consumer:
    async def total(self, value) -> float:  # the ref is fetched before the method runs
        return float(value["w"].sum())

    async def fetch_total(self, refs) -> float:
        return float((await rdt.fetch(refs[0]))["w"].sum())

    async def ping(self) -> str:
        return "pong"


@pytest.mark.parametrize("where", ["same node", "other node"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_producer_killed_before_the_fetch_gives_peer_died_error(transport, where):
    if transport == "shm" and where == "other node":
        pytest.skip("shm serves its own node only")
    producer = _producer(transport).remote()
    consumer = (Consumer.options(**ON_NODE2) if where == "other node" else Consumer).remote()
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = producer.make.remote()
        assert ray.get(consumer.fetch_total.remote([ref]), timeout=60) == 2.0 * N  # it works while alive
        ref = producer.make.remote()
        ray.wait([ref], timeout=60)
        ray.kill(producer)
        time.sleep(1.0)  # its sockets and endpoints close: the fetch meets a dead peer, not a dying one
        started = time.monotonic()
        with pytest.raises(rdt.PeerDiedError, match=r"died|disconnected"):
            ray.get(consumer.total.remote(ref), timeout=60)
        assert time.monotonic() - started < 15
        assert ray.get(consumer.ping.remote(), timeout=30) == "pong"  # the consumer serves on
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(producer)
        ray.kill(consumer)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_producer_killed_as_the_fetch_starts_gives_peer_died_error(transport):
    producer = _producer(transport).remote()
    consumer = Consumer.remote()
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = producer.make.remote()
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
        ray.kill(consumer)


@rdt.remote
class SlowConsumer:
    async def fetch_forever(self, refs) -> None:
        while True:  # fetch again and again until killed: the kill lands mid-fetch
            value = await rdt.fetch(refs[0])
            del value

    async def ping(self) -> str:
        return "pong"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_consumer_killed_mid_fetch_leaves_the_producer_clean(transport):
    @rdt.remote
    class Producer:
        @rdt.method(tensor_transport=transport)
        def make(self):
            return {"w": torch.full((1 << 23,), 2.0)}  # 32 MiB: a fetch takes a while

        def held(self) -> int:
            return rdt.store_stats()["objects"]

        def ping(self) -> str:
            return "pong"

    producer, consumer = Producer.remote(), SlowConsumer.remote()
    group = rdt.create_collective_group([producer, consumer], backend="gloo") if transport == "gloo" else None
    try:
        ref = producer.make.remote()
        ray.wait([ref], timeout=60)
        consumer.fetch_forever.remote([ref])
        time.sleep(1.0)
        ray.kill(consumer)
        del ref
        deadline = time.monotonic() + 20
        while ray.get(producer.held.remote(), timeout=30) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.get(producer.held.remote(), timeout=30) == 0  # nothing kept for the dead consumer
        assert ray.get(producer.ping.remote(), timeout=30) == "pong"
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        ray.kill(producer)
        ray.kill(consumer)


@pytest.mark.parametrize("transport", ["object_store", "tcp"])
def test_a_producer_that_ray_restarted_is_dead_for_its_objects(transport):
    """With max_restarts, Ray brings a crashed producer back as a new process, which holds
    none of the old one's objects: fetching them is a death (PeerDiedError, so callers
    retry elsewhere), not an ObjectFreedError or a TransferError about a live producer."""
    producer = _producer(transport).options(max_restarts=1, **ON_NODE2).remote()
    consumer = Consumer.remote()
    try:
        ref = producer.make.remote()
        assert ray.get(consumer.fetch_total.remote([ref]), timeout=60) == 2.0 * N
        ref = producer.make.remote()
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
    finally:
        ray.kill(producer)
        ray.kill(consumer)
