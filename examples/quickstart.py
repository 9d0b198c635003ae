"""A trainer keeps its weights; an async server awaits them without blocking its loop."""

import asyncio

import ray
import torch

import rdt_async as rdt


@rdt.remote
class Trainer:
    def __init__(self):
        self.w = torch.randn(1024, 1024)

    @rdt.method  # tensors in the return value stay here until a consumer fetches them
    def weights(self, step: int):
        return {"w": self.w * step, "step": step}


@rdt.remote
class Server:
    async def load(self, weights):  # top-level RDT arguments arrive already fetched
        self.weights = weights
        return weights["step"], float(weights["w"].sum())

    async def load_many(self, refs):  # refs nested in containers: fetch them yourself
        before = dict(rdt.store_stats()["fetches"])  # this process's fetches so far, by transport
        async with asyncio.timeout(30):
            values = await rdt.fetch_all(refs)
        after = rdt.store_stats()["fetches"]
        return [v["step"] for v in values], {t: n - before.get(t, 0) for t, n in after.items() if n > before.get(t, 0)}


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)  # a fresh local Ray for this example
    try:
        trainer, server = Trainer.remote(), Server.remote()
        ref = trainer.weights.remote(step=1)
        print("the ref holds:", ray.get(ref))
        step, total = ray.get(server.load.remote(ref))
        print(f"server loaded step {step}, checksum {total:.2f}")
        steps, used = ray.get(server.load_many.remote([trainer.weights.remote(s) for s in (2, 3)]))
        print("server fetched steps", steps, "over", used)
        print("driver got", rdt.get(ref, timeout=30)["w"].shape)
    finally:
        ray.shutdown()
