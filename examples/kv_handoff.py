"""Disaggregated inference: a prefill actor hands each request's KV cache to a decode actor.

The prefill actor builds a request's KV cache (keys and values per layer) and returns it;
the decode actor fetches it with `into=` a block of its own cache, preallocated once and
reused request after request, so a handoff allocates nothing. The decode actor's loop
stays free while a cache arrives: a status call sent once the cache is made, as decode
fetches it, is answered, and the example checks and says whether that was while the
cache was arriving. Runs on CPU as it is: `python examples/kv_handoff.py`.
"""

import time

import ray
import torch

import rdt_async as rdt

LAYERS, HEADS, TOKENS, DIM = 8, 8, 512, 64  # 8 layers x 2 x 1 MiB: 16 MiB of cache per request
SLOTS, REQUESTS = 2, 6


@rdt.remote
class Prefill:
    @rdt.method
    def prefill(self, request: int):
        g = torch.Generator().manual_seed(request)  # a real one: a forward pass over the prompt
        kv = [(torch.randn(HEADS, TOKENS, DIM, generator=g), torch.randn(HEADS, TOKENS, DIM, generator=g))
              for _ in range(LAYERS)]
        return {"request": request, "kv": kv}


@rdt.remote
class Decode:
    def __init__(self):
        shape = (HEADS, TOKENS, DIM)
        self.slots = [[(torch.empty(shape), torch.empty(shape)) for _ in range(LAYERS)] for _ in range(SLOTS)]
        self.addresses = {t.data_ptr() for slot in self.slots for kv in slot for t in kv}

    async def take(self, refs, slot: int) -> dict:
        started = time.perf_counter()
        value = await rdt.fetch(refs[0], into={"request": None, "kv": self.slots[slot]})
        landed = time.perf_counter()
        kv = value["kv"]
        g = torch.Generator().manual_seed(value["request"])
        exact = all(torch.equal(k, torch.randn(HEADS, TOKENS, DIM, generator=g))
                    and torch.equal(v, torch.randn(HEADS, TOKENS, DIM, generator=g)) for k, v in kv)
        in_place = {t.data_ptr() for pair in kv for t in pair} <= self.addresses
        return {"request": value["request"], "started": started, "landed": landed, "exact": exact, "in_place": in_place}

    async def status(self) -> tuple[str, float]:
        return "decoding", time.perf_counter()  # (when it was answered: this process's clock, as take's)


def main() -> None:
    prefill, decode = Prefill.remote(), Decode.remote()
    ray.get(decode.status.remote())
    during = 0
    for request in range(REQUESTS):
        ref = prefill.prefill.remote(request)
        took = decode.take.remote([ref], request % SLOTS)
        ray.wait([ref])  # the cache is made: decode, waiting for it, now fetches it
        t0 = time.perf_counter()
        status, answered = ray.get(decode.status.remote())  # sent while the cache is on its way
        status_ms = (time.perf_counter() - t0) * 1e3
        r = ray.get(took)
        assert status == "decoding" and r["request"] == request and r["exact"] and r["in_place"], r
        if answered < r["started"]:
            when = "before decode asked for the cache"
        elif answered <= r["landed"]:
            when, during = "while the cache arrived", during + 1
        else:
            when = "after the cache had landed"
        print(f"request {request}: {LAYERS * 2 * HEADS * TOKENS * DIM * 4 >> 20} MiB of KV cache into slot "
              f"{request % SLOTS} {(r['landed'] - r['started']) * 1e3:.1f} ms after decode asked, exact, no allocation; "
              f"a status call sent meanwhile took {status_ms:.1f} ms, answered {when}")
    print(f"{during} of {REQUESTS} status calls were answered while a cache arrived")


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)  # a fresh local Ray for this example
    try:
        main()
    finally:
        ray.shutdown()
