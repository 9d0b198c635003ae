"""Data-parallel training driven from the driver: gradients averaged with one `rdt.allreduce`.

Four workers hold the same small model and train on their own shard of the data. Each
step, every worker returns its gradients as an RDT object (they stay in the worker);
the driver averages them across the workers with `rdt.allreduce(op="avg")`, which runs
one fused Gloo allreduce per dtype inside the workers and leaves each worker holding
the average; each worker then applies the average it holds.

For comparison, the imperative way: every worker fetches all the gradients itself and
averages them (n fetches per worker, written out in `average_yourself`).

Run: python examples/data_parallel.py
"""

import ray
import torch

import rdt_async as rdt

WORKERS = 4


@rdt.remote
class Worker:
    def __init__(self, rank: int):
        torch.manual_seed(0)  # the same initial model everywhere
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        g = torch.Generator().manual_seed(rank)  # this worker's shard of the data
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    @rdt.method(tensor_transport="gloo")  # the gradients stay here; members fetch them over Gloo
    async def gradients(self):
        self.model.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        return {name: p.grad.clone() for name, p in self.model.named_parameters()}

    async def apply(self, grads, lr: float = 0.1):
        # A top-level RDT argument arrives fetched; this one is held here, so it is the
        # stored average itself (no copy). Worker 0's average was also fetched by the
        # driver (rdt.get below), so worker 0 warns that it shares those tensors; the
        # warning goes to its log (log_to_driver=False keeps it off this output).
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p -= lr * grads[name]
        return self.checksum()

    async def average_yourself(self, refs):
        """The imperative way: fetch every worker's gradients and average them here."""
        values = await rdt.fetch_all(refs)
        return {name: torch.stack([v[name] for v in values]).mean(0) for name in values[0]}

    def checksum(self) -> float:
        return round(sum(float(p.double().sum()) for p in self.model.parameters()), 6)


def grad_norm(grads: dict) -> float:
    """The norm of the whole gradient: of every parameter's tensor as one vector."""
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))


def main() -> None:
    ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    try:
        workers = [Worker.remote(rank) for rank in range(WORKERS)]
        group = rdt.create_collective_group(workers)
        for step in range(3):
            grads = [w.gradients.remote() for w in workers]

            # Declarative: one call from the driver; worker i now holds the average in avg[i].
            avg = rdt.allreduce(grads, op="avg")

            # The imperative way gives the same numbers.
            by_hand = ray.get(workers[0].average_yourself.remote(grads))
            ours = rdt.get(avg[0], timeout=60)
            same = all(torch.allclose(ours[k], by_hand[k], atol=1e-6) for k in ours)

            checksums = ray.get([w.apply.remote(a) for w, a in zip(workers, avg)])
            print(f"step {step}: |avg grad| = {grad_norm(ours):.4f}, same as by hand: {same}, model checksums {checksums}")
            assert same and len(set(checksums)) == 1  # every replica took the same step

        rdt.destroy_collective_group(group)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
