"""A Ray Client driver for test_ray_client.py: `python ray_client_driver.py ray://host:port`
connects as a notebook would (`ray.init("ray://...")`), does what its user would with
rdt_async, and prints what each step did as one JSON line: {step: ["ok", value] or
["error", type name, message]}. Every wait is bounded."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from typing import Any

import ray
import torch
from helpers import SyncProducer

import rdt_async as rdt

# float32s: 4 KiB (its bytes ride in the ref), 4 MiB, 16 MiB, 64 MiB
SMALL, MID, BIG, LARGE = 1 << 10, 1 << 20, 4 << 20, 16 << 20
WAIT_S = 60


def checksum(t: torch.Tensor) -> str:
    """The digest of a tensor's bytes (a float sum differs with the order of its additions)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()[:16]


def expected(n: int, seed: int) -> str:
    """The checksum of `SyncProducer.make(n, seed)["w"]`."""
    return checksum(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def step(fn: Any) -> list[Any]:
    try:
        return ["ok", fn()]
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc  # (an actor's error: what it raised)
        return ["error", type(cause).__name__, str(cause)]


async def fetched(ref: Any, **kw: Any) -> str:
    async with asyncio.timeout(WAIT_S):
        return checksum((await rdt.fetch(ref, **kw))["w"])


async def waited(t: torch.Tensor) -> None:
    async with asyncio.timeout(5):
        await rdt.wait_tensor_freed(t)


def freed(p: Any, ref: Any) -> bool:
    """Free `ref` here and say whether its producer let it go (within 5 s: `rdt.free` only
    sends it word)."""
    objects = lambda: ray.get(p.stats.remote(), timeout=WAIT_S)["objects"]  # noqa: E731
    ray.wait([ref], timeout=WAIT_S)
    held = objects()
    rdt.free(ref)
    deadline = time.monotonic() + 5
    while objects() >= held and time.monotonic() < deadline:
        time.sleep(0.05)
    return objects() < held


@rdt.remote
class Consumer:
    async def checksum(self, value: Any) -> str:
        return checksum(value["w"])

    async def fetch(self, refs: list[Any], **kw: Any) -> str:
        return checksum((await rdt.fetch(refs[0], **kw))["w"])


def main(address: str) -> None:
    ray.init(address)
    out: dict[str, Any] = {}
    p, c = SyncProducer.remote(), Consumer.remote()
    got = lambda ref, **kw: checksum(rdt.get(ref, timeout=WAIT_S, **kw)["w"])  # noqa: E731
    # Between actors, arranged from here: every transport of the cluster's works.
    out["actor_to_actor"] = step(lambda: ray.get(c.checksum.remote(p.make.remote(MID, 1)), timeout=WAIT_S))
    # Here: the bytes in the ref, else the object store, through the client server.
    out["get_small"] = step(lambda: got(p.make.remote(SMALL, 2)))
    out["get_large"] = step(lambda: got(p.make.remote(LARGE, 3)))
    out["fetch_big"] = step(lambda: asyncio.run(fetched(p.make.remote(BIG, 4))))
    out["asked_object_store_small"] = step(lambda: got(p.make.remote(SMALL, 5), tensor_transport="object_store"))
    out["asked_shm"] = step(lambda: got(p.make.remote(MID, 6), tensor_transport="shm"))
    out["fetches"] = step(lambda: rdt.store_stats()["fetches"])
    out["why"] = step(lambda: rdt.store_stats()["auto"][-1]["why"])
    # Puts: the bytes go to the object store at once (or ride in the ref).
    w = torch.randn(MID, generator=torch.Generator().manual_seed(7))
    put = rdt.put({"w": w})
    out["put_to_actor"] = step(lambda: ray.get(c.checksum.remote(put), timeout=WAIT_S))
    out["put_here"] = step(lambda: got(put))
    out["put_shm"] = step(lambda: rdt.put({"w": w}, tensor_transport="shm"))
    out["wait_tensor_freed"] = step(lambda: asyncio.run(waited(w)))
    # Frees reach the producer.
    ref = p.make.remote(MID, 8)
    out["free"] = step(lambda: freed(p, ref))
    out["after_free"] = step(lambda: ray.get(c.fetch.remote([ref]), timeout=WAIT_S))
    # A collective group made from here: its members transfer over it.
    def grouped() -> str:
        group = rdt.create_collective_group([p, c], backend="gloo")
        try:
            return ray.get(c.fetch.remote([p.make.remote(MID, 9)], tensor_transport="gloo"), timeout=WAIT_S)
        finally:
            rdt.destroy_collective_group(group)

    out["group"] = step(grouped)
    sizes = {2: SMALL, 3: LARGE, 4: BIG, 5: SMALL}
    out["expected"] = {seed: expected(sizes.get(seed, MID), seed) for seed in range(1, 10)}
    print(json.dumps(out), flush=True)
    ray.kill(p)
    ray.kill(c)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
