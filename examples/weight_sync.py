"""Reinforcement-learning weight sync: a trainer publishes versioned weights to inference actors.

The trainer publishes each version with an `rdt.Publisher` and goes on training: the
copy into a warm slot is all it waits for, never a server. Each server follows the
newest version with `rdt.subscribe`, loading it into its own tensors (`into=`) while it
answers requests; one that falls behind skips to the newest, and never loads a mix of
two versions. Runs on CPU as it is: `python examples/weight_sync.py`.
"""

import asyncio
import time

import ray
import torch

import rdt_async as rdt

LAYERS, WIDTH = 4, 1 << 21  # 4 layers of 8 MiB
SERVERS, VERSIONS = 3, 4


@rdt.remote
class Trainer:
    def __init__(self):
        self.weights = {f"layer{i}": torch.zeros(WIDTH) for i in range(LAYERS)}
        self.publisher = rdt.Publisher("weights")  # warm slots in shared memory, recycled

    async def train(self) -> float:
        """Train and publish every version; return the longest publish (s)."""
        longest = 0.0
        for version in range(VERSIONS):
            for w in self.weights.values():
                w.fill_(float(version))  # a real trainer: optimizer.step()
            started = time.perf_counter()
            await self.publisher.publish(self.weights)  # a copy into a free slot, off the loop
            longest = max(longest, time.perf_counter() - started)
            await asyncio.sleep(0.05)  # the next step's compute
        return longest


@rdt.remote
class Server:
    def __init__(self):
        self.version = -1
        self.weights = {f"layer{i}": torch.empty(WIDTH) for i in range(LAYERS)}  # loaded in place

    async def follow(self, trainer) -> dict:
        versions, slowest = [], 0.0
        async with rdt.subscribe(trainer, "weights") as subscription:
            while self.version < VERSIONS - 1:
                version, weights = await subscription.next(into=self.weights)  # the newest, loaded in place
                self.version = version  # `weights` is self.weights, holding that version whole
                assert weights["layer0"] is self.weights["layer0"]
                assert all(bool((w == float(version)).all()) for w in self.weights.values()), version
                versions.append(version)
                slowest = max(slowest, rdt.store_stats()["subscriptions"][0]["apply_s"])  # its fetch
        return {"versions": versions, "slowest": slowest}

    async def infer(self, x: float) -> tuple[int, float]:
        await asyncio.sleep(0)  # a request: answered between the load's steps
        return self.version, x * float(self.weights["layer0"][0])


def main() -> None:
    trainer = Trainer.remote()
    servers = [Server.remote() for _ in range(SERVERS)]
    ray.get([s.infer.remote(0.0) for s in servers])  # started
    follows = [s.follow.remote(trainer) for s in servers]
    training = trainer.train.remote()
    slowest, requests = 0.0, 0
    while ray.wait(follows, num_returns=len(follows), timeout=0)[1]:
        t0 = time.perf_counter()
        ray.get([s.infer.remote(1.0) for s in servers])  # requests keep coming meanwhile
        slowest, requests = max(slowest, time.perf_counter() - t0), requests + 1
    for i, report in enumerate(ray.get(follows)):
        print(f"server {i}: versions {report['versions']}, each exact, loaded in "
              f"{report['slowest'] * 1e3:.0f} ms at most")
    print(f"trainer: {VERSIONS} versions of {LAYERS * WIDTH * 4 >> 20} MiB, the longest publish took "
          f"{ray.get(training) * 1e3:.1f} ms; it waited for no server")
    print(f"{requests} request rounds answered meanwhile, slowest {slowest * 1e3:.1f} ms")
    print("served versions:", sorted({v for v, _ in ray.get([s.infer.remote(1.0) for s in servers])}))


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)  # a fresh local Ray for this example
    try:
        main()
    finally:
        ray.shutdown()
