"""Pipeline parallelism: activations flow through three stage actors, micro-batches in flight.

Each stage holds its layer and returns its activations, which stay in its process; the
next stage receives the ref as an argument and gets the tensor itself (rdt fetches
top-level arguments before the method runs). The driver sends the inputs and passes refs:
no activation between stages goes through it or through Ray's object store. Runs on CPU as it is:
`python examples/pipeline.py`.
"""

import time

import ray
import torch

import rdt_async as rdt

WIDTH, BATCH, MICRO_BATCHES, STAGES = 1024, 256, 8, 3  # 1 MiB of activations per micro-batch


def layer(stage: int) -> torch.Tensor:
    return torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(stage)) / WIDTH**0.5


@rdt.remote
class Stage:
    def __init__(self, stage: int):
        self.weight = layer(stage)

    @rdt.method
    async def forward(self, x: torch.Tensor) -> torch.Tensor:  # x arrives fetched, wherever it was
        return torch.tanh(x @ self.weight)

    def ready(self) -> bool:
        return True


def main() -> None:
    stages = [Stage.remote(i) for i in range(STAGES)]
    inputs = [torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(100 + m)) for m in range(MICRO_BATCHES)]
    ray.get([s.ready.remote() for s in stages])  # started: the clock counts the work alone
    started = time.perf_counter()
    outs = []
    for x in inputs:  # every micro-batch is submitted at once: the stages work on several
        ref = x
        for s in stages:
            ref = s.forward.remote(ref)
        outs.append(ref)
    results = [rdt.get(ref, timeout=120) for ref in outs]
    took = time.perf_counter() - started
    for m, (x, y) in enumerate(zip(inputs, results)):
        expected = x
        for i in range(STAGES):
            expected = torch.tanh(expected @ layer(i))
        gap = (y - expected).abs().max().item()  # (rounding: up to ~1e-4 seen; a wrong tensor: ~1)
        assert torch.allclose(y, expected, rtol=1e-4, atol=1e-4), f"micro-batch {m} differs from a local pass by up to {gap:.3g}"
    print(f"{MICRO_BATCHES} micro-batches of {BATCH}x{WIDTH} through {STAGES} stages in {took * 1e3:.0f} ms, "
          f"all match a local forward pass")


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)  # a fresh local Ray for this example
    try:
        main()
    finally:
        ray.shutdown()
