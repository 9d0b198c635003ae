"""Reinforcement-learning weight sync: a trainer publishes versioned weights to inference actors.

The trainer keeps its weights and returns them at every version; each inference actor
loads them with `await rdt.fetch(ref, into=...)` into buffers it reuses, and answers
requests all the while. Before the trainer writes the next version in place,
`rdt.wait_tensor_freed` waits until no one can still read the published one, so no server
ever loads a mix of two versions. Runs on CPU as it is: `python examples/weight_sync.py`.
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
        self.version = 0
        # In shared memory once, before anything else reads them: every publish then
        # exports them to servers on this node without a copy (rdt_async never moves them).
        self.weights = [torch.zeros(WIDTH).share_memory_() for _ in range(LAYERS)]

    @rdt.method  # the tensors stay here; servers read them where they are
    def publish(self):
        return {"version": self.version, "layers": self.weights}

    async def train_step(self) -> float:
        """Write the next version in place, once nothing reads the last one; return the wait (s)."""
        started = time.perf_counter()
        for w in self.weights:
            await rdt.wait_tensor_freed(w)
        waited = time.perf_counter() - started
        self.version += 1
        for w in self.weights:
            w.fill_(float(self.version))  # a real trainer: optimizer.step()
        return waited


@rdt.remote
class Server:
    def __init__(self):
        self.version = -1
        self.layers = [torch.empty(WIDTH) for _ in range(LAYERS)]  # reused at every load

    async def load(self, refs) -> dict:
        started = time.perf_counter()
        into = {"version": None, "layers": self.layers}
        value = await rdt.fetch(refs[0], into=into)  # nothing of the trainer's memory kept
        self.version = value["version"]
        exact = all(bool((w == float(self.version)).all()) for w in self.layers)
        return {"version": self.version, "seconds": time.perf_counter() - started, "exact": exact}

    async def infer(self, x: float) -> tuple[int, float]:
        await asyncio.sleep(0)  # a request: answered between the load's steps
        return self.version, x * float(self.layers[0][0])


def main() -> None:
    trainer = Trainer.remote()
    servers = [Server.remote() for _ in range(SERVERS)]
    ray.get([s.infer.remote(0.0) for s in servers])  # started
    for _ in range(VERSIONS):
        ref = trainer.publish.remote()
        loads = [s.load.remote([ref]) for s in servers]
        slowest, requests = 0.0, 0
        while ray.wait(loads, num_returns=len(loads), timeout=0)[1]:
            t0 = time.perf_counter()
            ray.get([s.infer.remote(1.0) for s in servers])  # requests keep coming meanwhile
            slowest, requests = max(slowest, time.perf_counter() - t0), requests + 1
        reports = ray.get(loads)
        del ref, loads  # the published version is no longer needed: the trainer may write
        waited = ray.get(trainer.train_step.remote())
        version = reports[0]["version"]
        assert all(r["version"] == version and r["exact"] for r in reports), reports
        print(
            f"version {version}: {SERVERS} servers loaded {LAYERS * WIDTH * 4 >> 20} MiB in "
            f"{max(r['seconds'] for r in reports) * 1e3:.0f} ms, exact; {requests} request rounds "
            f"meanwhile, slowest {slowest * 1e3:.1f} ms; the trainer waited {waited * 1e3:.1f} ms to write"
        )
    print("served versions:", sorted({v for v, _ in ray.get([s.infer.remote(1.0) for s in servers])}))


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)  # a fresh local Ray for this example
    try:
        main()
    finally:
        ray.shutdown()
