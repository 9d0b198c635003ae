"""Versioned publishing across hosts: a trainer publishes its state dict every step to 8 subscribers (issue 33).

`python -m rdt_async.bench --hosts three --only publish`: a trainer on the head host
keeps a state dict of ~200 tensors (`--publish-sizes`, 1 GiB by default) in shared
memory; 8 async inference actors, 4 on each other host, load every version into their
own model's tensors. A pass publishes `STEPS` versions, the trainer writing the step's
number into every tensor first (its training step, not timed) after a pause (`pause`,
PAUSE_S by default: longer than the actors keep idle warm memory, as a trainer's step of
tens of seconds is longer than the 10 s they keep it by default), by one path; the paths
take turns (`_turns.in_turns`: within a round, each follows every other equally often over
a cycle of rounds):

- `rdt publish`: an `rdt.Publisher` in the trainer; each subscriber waits in `await
  sub.next(into=its model)`.
- `rdt publish, lent`: the same publisher, publishing the trainer's own shared tensors
  (`publish(lend=True)`, no copy), the trainer waiting in `wait_unread` before it writes
  them again.
- `rdt publish, stream`: the same publisher, each subscriber iterating
  `sub.stream(into=its model)` tensor by tensor.
- `ray object store zero-copy`: the trainer `ray.put`s the state dict once per step
  (`RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`) and the ref goes to all 8; each awaits it
  and copies it into its model.
- `hand-written`: today's pattern without a publisher (examples/weight_sync.py before
  it): the trainer waits with `rdt.wait_tensor_freed` until nobody reads its weights,
  writes them in place, and an `@rdt.method` returns them: a ref per step, which each
  subscriber fetches with `rdt.fetch(ref, into=its model)`.

Each subscriber checks the version it got (one element of every 4 KiB page of every
tensor must hold the step's number: a wrong version or a mix of two is an error row, not
a timing). `seconds`: the median over the warm steps (every round but the first) of
the time from the producing call (the trainer's `publish` or `ray.put`; for the
hand-written pattern the driver's call of the producing method) until all 8 hold that
version and have checked it (`passes_s`: every warm step's, by round; `turns`: the path's
place in each round);
`trainer_stall_s`: how long publishing blocked the trainer (`hand-written`: its wait
before writing in place), against one warm copy of the state dict into memory of its own
made by the trainer just before, in the same steps (`one_copy_s`; `quiet_copy_s`: the
same copy at setup, before anything else ran);
`loop_stall_ms`: the subscribers' worst event-loop stall while versions arrived
(`loop_held_ms`: less the loop thread's waits for a core);
`publisher_bytes`: the publisher's slots (`Publisher.stats()`) against the state's
bytes; `breakdown`: when the first subscriber, those that read over the link, those the
relay served and all held the version (publishing paths: when the last heard of it). A
path that breaks (an actor killed) keeps the passes it finished and says what broke
(`broke`). The subscribers are `rdt.remote` actors on every path (Ray's path only awaits
a plain ref in them).
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._fanout import (
    RAY_ZERO_COPY,
    ZERO_COPY_ENV,
    Sized,
    _Loader,
    each_size,
    fetches_since,
    placements,
    vs_ray_zero_copy,
)
from ._loop import LoopStall
from ._progress import Progress
from ._turns import take_turns
from ._units import human

TENSORS = 200  # the state dict's: half of them large (a layer's weight), half 4 KiB (its norm)
SMALL = 1024  # elements of a small tensor
STEPS = 4  # versions a pass publishes
PAGE = 4096  # a subscriber checks one element of every page
RDT_PUBLISH, RDT_LENT, RDT_STREAM = "rdt publish", "rdt publish, lent", "rdt publish, stream"
HAND_WRITTEN = "hand-written"
PATHS = (RDT_PUBLISH, RDT_LENT, RDT_STREAM, RAY_ZERO_COPY, HAND_WRITTEN)
PUBLISHED = (RDT_PUBLISH, RDT_LENT, RDT_STREAM)  # the subscribers wait for the version before it is published
# Every host shares one machine (24 GiB here): 8 models, the trainer's slots and Ray's
# store on three nodes leave no room for rdt's idle warm shared memory, kept 10 s by
# default (the relay's memfds, each version's, stay mapped that long in every subscriber
# of a host). The actors keep it IDLE_S instead, and each pass is followed by a pause that
# lets one path's idle memory go before the next.
IDLE_S = 1.0
PAUSE_S = IDLE_S + 0.5  # between the versions of a pass (`run`): what users' steps are to their idle time
ENV = {"env_vars": {**ZERO_COPY_ENV["env_vars"], "RDT_SHM_IDLE_S": str(IDLE_S)}}  # (zero-copy: Ray's path only)


def _state(size: int) -> dict[str, torch.Tensor]:
    """A state dict of `size` bytes in all (unwritten): `TENSORS` float32 tensors, as a model's."""
    layers = TENSORS // 2
    n = max(1, (size - layers * SMALL * 4) // 4 // layers)
    state = {}
    for i in range(layers):
        state[f"layer{i}.weight"] = torch.empty(n)
        state[f"layer{i}.norm"] = torch.empty(SMALL)
    return state


def _copy_into(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in src.items():
            dst[name].copy_(t)


def _copy_target(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors like `state`'s in one storage of their own (as a publisher's slot), for timing
    one warm copy. One storage, so that its memory goes back when it does."""
    sizes = [t.numel() for t in state.values()]
    flat = torch.empty(sum(sizes))  # (the state is float32)
    return {k: part.view(t.shape) for (k, t), part in zip(state.items(), flat.split(sizes))}


def _copy_s(into: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    _copy_into(into, state)
    return time.perf_counter() - started


def _wrong(model: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], value: float) -> str | None:
    """What is wrong with the version `got` (it must be `model`'s tensors, each holding `value`), or None."""
    for name, t in model.items():
        if got[name].data_ptr() != t.data_ptr():
            return f"{name} did not land in the model's tensor"
        flat = t.reshape(-1)
        seen = torch.cat([flat[:: PAGE // t.element_size()], flat[-1:]])
        if not bool((seen == value).all()):
            return f"{name} holds {seen.unique().tolist()[:4]}, not {value:g} throughout"
    return None


@rdt.remote
class Trainer:
    """Keeps a state dict in shared memory; each step writes it, then publishes it by one path."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.copy_into: dict[str, torch.Tensor] = {}  # where `step` times a warm copy of `state`
        self.publisher: rdt.Publisher | None = None

    async def setup(self, size: int, name: str) -> dict[str, float]:
        """Make the state dict and its publisher; its bytes and one warm copy's time."""
        self.state = await asyncio.to_thread(lambda: {k: t.share_memory_() for k, t in _state(size).items()})
        self.publisher = rdt.Publisher(name)
        self.copy_into = await asyncio.to_thread(_copy_target, self.state)
        took = [await asyncio.to_thread(_copy_s, self.copy_into, self.state) for _ in range(4)]
        return {"state_bytes": sum(t.nbytes for t in self.state.values()), "one_copy_s": statistics.median(took[1:])}

    async def step(self, path: str, value: float) -> tuple[float | None, float, list[Any], float]:
        """Train (write `value` everywhere), then publish by `path`: (when publishing began,
        how long it blocked the trainer, refs for the subscribers, how long one warm copy of
        the state took just before: the machine as it is at that step)."""
        assert self.publisher is not None  # (made by setup)
        if path != RDT_LENT:  # the lent path's last version offers `state` still: withdraw it (not timed)
            await self.publisher.wait_unread(self.state)
        started = time.perf_counter()
        if path == RDT_LENT:
            await self.publisher.wait_unread(self.state)  # the version it lent: its readers are done
        elif path == HAND_WRITTEN:
            for t in self.state.values():
                await rdt.wait_tensor_freed(t)  # nobody may read the version before
        waited = time.perf_counter() - started  # (other paths copied it: nothing holds the state)
        await asyncio.to_thread(lambda: [t.fill_(value) for t in self.state.values()])
        one_copy = await asyncio.to_thread(_copy_s, self.copy_into, self.state)
        if path == HAND_WRITTEN:
            return None, waited, [], one_copy  # `weights` publishes it: the wait is what it cost the trainer
        at, started = time.time(), time.perf_counter()
        refs = []
        if path == RAY_ZERO_COPY:
            refs.append(ray.put(self.state))
        else:
            await self.publisher.publish(self.state, lend=path == RDT_LENT)
        stall = time.perf_counter() - started
        return at, stall + (waited if path == RDT_LENT else 0.0), refs, one_copy  # lent: the wait is its own

    @rdt.method(tensor_transport="auto")
    def weights(self) -> dict[str, torch.Tensor]:
        """The hand-written path's publish: the kept weights themselves (its clock starts
        at the driver's call of this method, `_one_step`)."""
        return self.state

    def memory(self) -> dict[str, Any]:
        assert self.publisher is not None
        return self.publisher.stats()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.publisher, self.state, self.copy_into = None, {}, {}

    def pid(self) -> int:
        return os.getpid()


@rdt.remote
class Subscriber(_Loader):
    """An async inference actor: loads each version into its own model's tensors and checks it."""

    weights = staticmethod(_state)

    def __init__(self) -> None:
        super().__init__()
        self.sub: rdt.Subscription | None = None

    async def prepare(self, size: int, trainer: Any, name: str) -> None:
        """Allocate and write the model (warm), and subscribe to `name`."""
        await asyncio.to_thread(self.model, size)
        self.sub = rdt.subscribe(trainer, name)

    def let_go_warm(self) -> None:
        """Before a hand-written version after a pause longer than idle warm memory is kept
        (untimed, in the pause): that pattern has no subscription, so nothing keeps the
        relay's memory warm between its versions (this actor's subscription does for the
        other paths, and takes it up again at its next version); let go of what the idle
        sweep would have closed meanwhile."""
        assert self.sub is not None  # (made by prepare)
        self.sub._let_go_warm()
        self.forget_warm()

    async def take(self, path: str, size: int, value: float, refs: list[Any]) -> dict[str, Any]:
        """Load the next version by `path`, then check it: when it was checked, the loop's
        worst stall meanwhile, what went wrong."""
        model, sub = self.model(size), self.sub
        assert sub is not None  # (made by prepare)
        before = dict(rdt.store_stats()["fetches"])
        stall = LoopStall()
        try:
            if path in (RDT_PUBLISH, RDT_LENT):
                got = (await sub.next(into=model))[1]
            elif path == RDT_STREAM:
                got = {n: t async for n, t in sub.stream(into=model)}
            elif path == HAND_WRITTEN:
                got = await rdt.fetch(refs[0], into=model)
            else:
                state = await refs[0]  # views of the node's copy in Ray's store
                await asyncio.to_thread(_copy_into, model, state)
                got, state = model, None
        finally:
            stalled = stall.stop()
        loaded = time.time()
        wrong = await asyncio.to_thread(_wrong, model, got, value)
        return {"loaded": loaded, "done": time.time(), "stall_s": stalled, "held_s": stall.held, "wrong": wrong,
                "used": fetches_since(before), "apply_s": sub.apply_s if path in PUBLISHED else None}


def run(sizes: list[int], repeat: int, hosts: int, progress: Progress | None = None,
        pause: float = PAUSE_S) -> list[dict[str, Any]]:
    """Every size, the paths in turns: a cold pass of each, then `repeat` rounds of warm ones;
    `pause` seconds before each version (0: back to back)."""

    def setup() -> tuple[list[Any], Sized]:
        trainer = Trainer.options(runtime_env=ENV).remote()
        subs = [Subscriber.options(**w, runtime_env=ENV).remote() for w in placements()]

        def one_size(size: int) -> list[dict[str, Any]]:
            short = too_big(size, len(subs))
            if short is not None:  # (this machine holds every host: refused before it runs out)
                return [{"bench": "publish", "case": p, "size": size, "error": short} for p in PATHS]
            try:
                return _size(trainer, subs, size, repeat, pause)
            except Exception as e:  # the setup failed: every path's row says so
                error = f"{type(e).__name__}: {e}"[:400]
                return [{"bench": "publish", "case": p, "size": size, "error": error} for p in PATHS]

        return [trainer, *subs], one_size

    return each_size("publish", PATHS, sizes, hosts, progress, setup,
                     f"publish {{size}} every step to {len(placements())} subscribers on 2 hosts, "
                     f"{len(PATHS)} paths in turns")


# Memory a run takes per byte of the state, every host on this machine: the trainer's state
# and slots, each subscriber's model and what it reads into, each host's relayed copies,
# Ray's store on each node. 1 GiB to 8 subscribers went to 22 GB and Ray's OOM killer.
BYTES_PER_STATE_BYTE = 21
BASE_BYTES = 2 << 30  # the processes themselves (torch in each)


def too_big(size: int, subscribers: int, available: int | None = None) -> str | None:
    """Why publishing `size` to `subscribers` cannot run on this machine, or None: the
    three hosts share its memory (`MemAvailable` unless `available` is given)."""
    need = BYTES_PER_STATE_BYTE * size * subscribers // 8 + BASE_BYTES
    if available is None:
        available = _available_bytes()
    if available is None:
        return None
    budget = available * 9 // 10  # (Ray's OOM killer acts at 95% used)
    if need <= budget:
        return None
    fits = max(0, (budget - BASE_BYTES) * 8 // (BYTES_PER_STATE_BYTE * subscribers))
    return (f"publishing {human(size)} to {subscribers} subscribers needs about {human(need)} of memory "
            f"with every host on this machine, which has {human(available)} available: pass "
            f"--publish-sizes {fits >> 20}M or less, or run on a machine with more memory")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(trainer: Any, subs: list[Any], size: int, repeat: int, pause: float = PAUSE_S) -> list[dict[str, Any]]:
    name = f"weights-{size}"
    setup = ray.get(trainer.setup.remote(size, name), timeout=600)
    ray.get([s.prepare.remote(size, trainer, name) for s in subs], timeout=600)
    memory: dict[str, Any] = {}
    value = 0.0  # each step's number: every version differs from every other

    def one_pass(path: str) -> list[dict[str, Any]]:
        nonlocal value, memory
        steps = []
        for _ in range(STEPS):
            value += 1
            started = time.perf_counter()
            if path == HAND_WRITTEN and pause > IDLE_S:  # (see `Subscriber.let_go_warm`; not timed)
                ray.get([s.let_go_warm.remote() for s in subs], timeout=60)
            time.sleep(max(0.0, pause - (time.perf_counter() - started)))  # (the trainer's step: not timed)
            steps.append(_one_step(path, trainer, subs, size, value))
        if path in PUBLISHED:
            memory = ray.get(trainer.memory.remote())
        return steps

    # A wrong version (an AssertionError) makes the row an error, not a timing; a path
    # (or an actor) that broke otherwise keeps the passes it finished.
    turns = take_turns({p: functools.partial(one_pass, p) for p in PATHS}, repeat,
                       pause=lambda took: time.sleep(IDLE_S + 2))
    passes = {p: ([turns.cold[p]] if p in turns.cold else []) + turns.warm[p] for p in PATHS}
    wrong = {p: f"{type(e).__name__}: {e}"[:400] for p, (_, e) in turns.broke.items() if isinstance(e, AssertionError)}
    broke = {p: turns.why(p) or "" for p in turns.broke if p not in wrong}
    try:
        ray.get(trainer.close.remote())
    except ray.exceptions.RayError:  # (it died: the rows say what broke)
        pass
    rows = [{**_row(p, passes[p], wrong.get(p), broke.get(p), setup, memory, size, len(subs)), "pause_s": pause}
            for p in PATHS]
    for row in rows:
        if "seconds" in row:  # (the raw steps, in round order, and the path's place in each round)
            row.update(passes_s=[[round(s["seconds"], 6) for s in steps] for steps in passes[row["case"]][1:]],
                       turns=turns.turns[row["case"]])
    _with_ratios(rows)
    return rows


def _with_ratios(rows: list[dict[str, Any]]) -> None:
    """Give each timed row its ratios to Ray's zero-copy store and to the hand-written pattern."""
    vs_ray_zero_copy(rows)
    hand = next((r["seconds"] for r in rows if r["case"] == HAND_WRITTEN and "seconds" in r), None)
    for row in rows:
        if hand and "seconds" in row:
            row["vs_hand_written"] = round(row["seconds"] / hand, 3)


def _one_step(path: str, trainer: Any, subs: list[Any], size: int, value: float) -> dict[str, Any]:
    """Publish one version by `path` and wait until every subscriber has checked it.

    The clock starts where the path's producing call is made: the trainer's `publish` or
    `ray.put` (in `Trainer.step`), and for the hand-written pattern the driver's call of
    `trainer.weights` (the Ray call, the method and its export all count).
    """
    takes = [s.take.remote(path, size, value, []) for s in subs] if path in PUBLISHED else []
    at, stall, refs, one_copy = ray.get(trainer.step.remote(path, value), timeout=600)
    if path == HAND_WRITTEN:
        at = time.time()  # (every host is on this machine: one clock)
        refs = [trainer.weights.remote()]
    takes = takes or [s.take.remote(path, size, value, refs) for s in subs]
    del refs  # (each take holds its own)
    out = ray.get(takes, timeout=600)
    wrong = next((o["wrong"] for o in out if o["wrong"]), None)
    if wrong is not None:
        raise AssertionError(f"{path}, version {value:g}: {wrong}")
    assert at is not None  # (the trainer's, or the driver's call)
    used = [(k, n) for o in out for k, n in o["used"].items()]
    return {"seconds": max(o["done"] for o in out) - at, "trainer_stall_s": stall, "one_copy_s": one_copy,
            "stall_s": max(o["stall_s"] for o in out), "held_s": max(o["held_s"] for o in out), "link": sum(n for k, n in used if k != "relay"),
            "relayed": sum(n for k, n in used if k == "relay"), "breakdown": _breakdown(out, at)}


def _breakdown(out: list[dict[str, Any]], at: float) -> dict[str, float]:
    """When (from `at`) the subscribers held the version: the first, those that read it over
    the link, those the relay served, all; and (publisher) when the last heard of it."""
    linked = [o["loaded"] for o in out if any(k != "relay" for k in o["used"])]
    relayed = [o["loaded"] for o in out if "relay" in o["used"]]
    times = {"first_loaded_s": min(o["loaded"] for o in out), "all_loaded_s": max(o["loaded"] for o in out)}
    if all(o["apply_s"] is not None for o in out):  # (its fetch, from the poll's answer)
        times["answered_s"] = max(o["loaded"] - o["apply_s"] for o in out)
    if linked:
        times["link_loaded_s"] = max(linked)
    if relayed:
        times["relayed_loaded_s"] = max(relayed)
    return {k: t - at for k, t in times.items()}


def _row(path: str, passes: list[list[dict[str, Any]]], wrong: str | None, broke: str | None,
         setup: dict[str, float], memory: dict[str, Any], size: int, subscribers: int) -> dict[str, Any]:
    row: dict[str, Any] = {"bench": "publish", "case": path, "size": size, "subscribers": subscribers, "hosts": 3}
    warm = [s for steps in passes[1:] for s in steps]
    if wrong is not None or not warm:
        return {**row, "error": wrong or broke or "no warm step ran"}
    if broke is not None:
        row["broke"] = broke  # after the passes timed here

    def median(key: str) -> float:
        return float(statistics.median(s[key] for s in warm))

    row.update(cold_s=passes[0][0]["seconds"], seconds=median("seconds"), trainer_stall_s=median("trainer_stall_s"),
               loop_stall_ms=round(max(s["stall_s"] for s in warm) * 1e3, 3),
               loop_held_ms=round(max(s["held_s"] for s in warm) * 1e3, 3))
    # Where the time went, until every subscriber had checked the version (`seconds`).
    every = [k for k in warm[0]["breakdown"] if all(k in s["breakdown"] for s in warm)]
    row["breakdown"] = {k: round(statistics.median(s["breakdown"][k] for s in warm), 4) for k in every}
    # Against a warm copy timed in the same steps, just before each publish: on a machine
    # whose cores the other hosts' processes share, the same copy takes longer than on a quiet one.
    row["one_copy_s"], row["quiet_copy_s"] = median("one_copy_s"), setup["one_copy_s"]
    row["trainer_stall_vs_one_copy"] = round(row["trainer_stall_s"] / row["one_copy_s"], 3)
    row["state_bytes"] = setup["state_bytes"]
    if path != RAY_ZERO_COPY:
        row["link_transfers"], row["relayed"] = median("link"), median("relayed")
    if path == RDT_LENT:
        row["publisher_slots"] = row["publisher_bytes"] = 0  # the trainer's own buffers, published as they are
        row["memory_vs_state"] = 0.0
    elif path in PUBLISHED and memory:
        row["publisher_slots"], row["publisher_bytes"] = memory["slots"], memory["slots"] * memory["slot_bytes"]
        row["memory_vs_state"] = round(row["publisher_bytes"] / setup["state_bytes"], 3)
    return row
