"""Write your own transport: tensors through files in a spool directory.

Run it:  python examples/custom_transport.py

`SpoolTransport` is a complete one-sided transport for actors on one node. The producer
writes an object's tensors to one file when the value is returned (`prepare`); a
consumer reads that file with no help from the producer (`receive`, on rdt_async's I/O
loop, the read itself in a worker thread); the producer deletes the file when the last
ref to the object is gone (`garbage_collect`). A consumer that finds the producer's
process dead raises `rdt.PeerDiedError` and sweeps what it left. docs/src/custom-transport.md
walks through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import ray
import torch

import rdt_async as rdt


@dataclass(frozen=True)
class SpoolMeta:
    """What a consumer needs to read an object: its file, and who wrote it."""

    path: str
    pid: int


class SpoolTransport(rdt.Transport[SpoolMeta]):
    """Tensors through files on one node (CPU tensors, one-sided)."""

    devices = ("cpu",)
    one_sided = True
    reach = "node"  # files of this node: a consumer on another reads through the object store
    root = os.path.join(tempfile.gettempdir(), "rdt-spool")

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> SpoolMeta:
        """Write the tensors to a file. Runs on: producer, when the value is returned."""
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, f"{os.getpid()}-{obj_id}.pt")  # (a dead producer's are found by pid)
        torch.save([t.detach().clone() for t in tensors], path)  # clone: views save only their bytes
        return SpoolMeta(path, os.getpid())

    async def receive(
        self, info: rdt.TransferInfo[SpoolMeta], buffers: list[torch.Tensor] | None, channel
    ) -> list[torch.Tensor]:
        """Read the file off the loop. Runs on: consumer (rdt_async's I/O loop)."""
        meta = info.meta
        if not _alive(meta.pid):
            for stale in glob.glob(os.path.join(self.root, f"{meta.pid}-*.pt")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            why = f"the producer of {info.obj_id} (pid {meta.pid}) died"
            raise rdt.PeerDiedError(why, obj_id=info.obj_id)
        try:
            tensors = await asyncio.to_thread(torch.load, meta.path)
        except FileNotFoundError:
            raise rdt.ObjectFreedError(f"object {info.obj_id} was freed", obj_id=info.obj_id) from None
        if buffers is None:
            return tensors
        return [b.copy_(t) for b, t in zip(buffers, tensors)]

    def garbage_collect(self, obj_id: str, meta: SpoolMeta) -> None:
        """Delete the file. Runs on: producer, when the last ref is gone or on rdt.free()."""
        try:
            os.unlink(meta.path)
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Register before decorating methods that name it; actors created before or after, and
# actors in other processes, find it by name.
rdt.register_transport("spool", ["cpu"], SpoolTransport)


@rdt.remote
class Trainer:
    """A sync actor that keeps its weights and hands them out over the spool."""

    def __init__(self) -> None:
        self.w = torch.arange(6.0).reshape(2, 3)

    @rdt.method(tensor_transport="spool")
    def weights(self, step: int):
        return {"w": self.w * step, "step": step, "layers": [torch.ones(2), torch.zeros(3)]}

    def held(self) -> int:
        return rdt.store_stats()["objects"]

    def pid(self) -> int:
        return os.getpid()


@rdt.remote
class Server:
    """An async actor: its arguments arrive already fetched, its loop stays free."""

    async def load(self, weights) -> tuple[float, int, float]:
        return weights["w"].sum().item(), weights["step"], weights["layers"][0].sum().item()

    async def load_later(self, refs) -> list[float]:
        value = await rdt.fetch(refs[0])
        return value["w"][1].tolist()

    async def fetched_over(self) -> dict[str, int]:
        return rdt.store_stats()["fetches"]


def main() -> None:
    started = not ray.is_initialized()
    if started:
        ray.init(address="local")  # a fresh local instance, even if a cluster runs here
    actors, trainer_pid = [], None
    try:
        trainer, server = Trainer.remote(), Server.remote()
        actors = [trainer, server]
        trainer_pid = ray.get(trainer.pid.remote())
        ref = trainer.weights.remote(step=2)
        print("server loaded (sum of w, step, sum of layer 0):", ray.get(server.load.remote(ref)))
        print("server fetched w[1]:", ray.get(server.load_later.remote([ref])))
        print("driver got w:", rdt.get(ref)["w"].tolist())
        print("server fetched over:", ray.get(server.fetched_over.remote()))
        del ref
        for _ in range(100):  # the trainer lets go of the object once no ref is left
            if ray.get(trainer.held.remote()) == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        print("objects the trainer still holds:", ray.get(trainer.held.remote()))
    finally:  # (also when a call above failed, or the wait ran out with the object held)
        for actor in actors:
            ray.kill(actor)
        if trainer_pid is not None:  # what the killed trainer left in the spool
            for left in glob.glob(os.path.join(SpoolTransport.root, f"{trainer_pid}-*.pt")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(left)
        if started:
            ray.shutdown()


if __name__ == "__main__":
    main()
