"""A publisher in a container whose /dev/shm is 64 MiB (Docker's default): run by
test_small_shm.py under `unshare -m`, with a small tmpfs over /dev/shm; prints JSON."""

from __future__ import annotations

import asyncio
import json
import logging

import ray
import torch

import rdt_async as rdt

MiB = 1 << 20


@rdt.remote
class Trainer:
    def __init__(self) -> None:
        self.pubs: dict[str, rdt.Publisher] = {}
        self.said: list[str] = []
        said = self.said

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                said.append(record.getMessage())

        logging.getLogger("rdt_async").addHandler(Keep())

    async def publish(self, name: str, nbytes: int, value: float) -> str:
        if name not in self.pubs:
            self.pubs[name] = rdt.Publisher(name, slots=3)
        pub = self.pubs[name]
        try:
            async with asyncio.timeout(60):
                return f"version {await pub.publish({'w': torch.full((nbytes // 4,), value)})}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def stats(self, name: str) -> dict:
        return {k: self.pubs[name].stats()[k] for k in ("slots", "version")}

    def close(self, name: str) -> None:
        self.pubs.pop(name).close()  # (its slots go: nobody reads them)

    def warnings(self) -> list[str]:
        return self.said


@rdt.remote
class Reader:
    async def hold(self, trainer, name: str) -> int:
        """Read the newest version and keep its tensors (views of the trainer's slot)."""
        async with asyncio.timeout(60):
            version, self.held = await rdt.subscribe(trainer, name).next()
        return version

    def release(self) -> None:
        del self.held

    async def newest(self, trainer, name: str, nbytes: int) -> list:
        into = {"w": torch.zeros(nbytes // 4)}
        async with asyncio.timeout(60):
            version, _ = await rdt.subscribe(trainer, name).next(into=into)
        return [version, into["w"].unique().tolist()]


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * MiB)
    trainer, reader = Trainer.remote(), Reader.remote()
    out: dict = {}
    # 40 MiB: one slot fits, a second (the next version, while the first is the newest) does not
    out["too big"] = [ray.get(trainer.publish.remote("big", 40 * MiB, v)) for v in (0.0, 1.0)]
    out["too big stats"] = ray.get(trainer.stats.remote("big"))
    ray.get(trainer.close.remote("big"))
    # 24 MiB: two fit, a third (asked for while a reader holds one) does not
    small = 24 * MiB
    out["two fit"] = [ray.get(trainer.publish.remote("small", small, 0.0))]
    out["held"] = ray.get(reader.hold.remote(trainer, "small"))  # slot 1, version 0
    out["two fit"].append(ray.get(trainer.publish.remote("small", small, 1.0)))  # slot 2
    third = trainer.publish.remote("small", small, 2.0)  # no room for slot 3: waits for slot 1
    ready, _ = ray.wait([third], timeout=2)
    out["waited"] = not ready
    ray.get(reader.release.remote())
    out["two fit"].append(ray.get(third, timeout=60))
    out["small stats"] = ray.get(trainer.stats.remote("small"))
    out["said"] = ray.get(trainer.warnings.remote())
    out["read"] = ray.get(reader.newest.remote(trainer, "small", small))
    print(json.dumps(out))
    ray.shutdown()


if __name__ == "__main__":
    main()
