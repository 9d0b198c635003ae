"""End to end, as a user feels it: from the producing call until the consumer has read every byte.

The clock starts at the driver's `producer.make.remote(n)` and stops when the
consumer's method, which receives the ref as its argument, has summed every element:
the producer's export, the transfer, the consumer's read and Ray's calls all count.
Three producer shapes (SHAPES), the same code for every path: a tensor it keeps and
returns each step (a trainer publishing its weights), put in shared memory once with
`share_memory_()` as the docs recommend (`kept`), or left as it was made, as most users
do (`plain`: rdt's shm and Ray's object store copy a snapshot of it at each return; tcp,
nixl, ucxx and gloo serve the live tensor at the fetch, rdt's object_store copies it
then); and a fresh tensor each call (`fresh`). `rdt auto into=` is `auto` with a consumer that lands each value in a
tensor of its own (`rdt.fetch(ref, into=...)`). The first pass of each (path, shape, size) is
reported apart (cold: first touch of fresh memory, first use of a transport); the rest
give the warm median, each kept in the row (`passes_s`, in round order) with the path's
place in each round (`turns`: the paths take turns, see `run`). Every row carries its ratio to the best Ray path of the same run,
and `loop_stall_ms`: the longest the consumer's event loop was held while the value
arrived (Ray resolving the argument, or rdt fetching it), worst of the warm passes, as
an async actor's other calls feel it; None for Ray's RDT paths, whose consumer is a
sync actor (no loop: its other calls wait until the value is in).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

import rdt_async as rdt

from ._loop import LoopStall
from ._progress import Progress
from ._turns import Turns, end_actors, take_turns
from ._units import human

ZERO_COPY_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
RAY_PATHS = ("ray object store", "ray object store zero-copy", "ray rdt nixl", "ray rdt gloo")
INTO = "rdt auto into="  # the consumer loads each value into a buffer of its own, as a model's weights
LIMIT = "physical limit"  # the least a pass can cost on one node (see LimitProducer)
# Paths whose actors load the CPU while idle, run apart from the others: Ray's NIXL agents
# spin their progress threads (9 s of CPU in 5 idle seconds here, producer and consumer).
ALONE = ("ray rdt nixl",)


SHAPES = ("kept", "plain", "fresh")


def _value(kept: dict[tuple[int, str], torch.Tensor], n: int, shape: str) -> torch.Tensor:
    """The producer's return: a fresh tensor, or one it keeps. `kept` is put in shared
    memory once, as rdt_async's docs ask of a trainer's weights (every path runs this same
    code; only shm reads it there without a copy); `plain` is not."""
    if shape == "fresh":
        return torch.full((n,), 1.0)
    if (n, shape) not in kept:
        t = torch.full((n,), 1.0)
        kept[n, shape] = t.share_memory_() if shape == "kept" else t
    return kept[n, shape]


def _rdt_producer(transport: str) -> Any:
    @rdt.remote
    class Producer:
        def __init__(self) -> None:
            self.kept: dict[tuple[int, str], torch.Tensor] = {}

        @rdt.method(tensor_transport=transport)
        def make(self, n: int, shape: str) -> torch.Tensor:
            return _value(self.kept, n, shape)

        def pid(self) -> int:
            return os.getpid()

    return Producer


def _read_parts(t0: float, value: torch.Tensor) -> tuple[float, float, float]:
    """(sum, seconds from `t0` until `value` was had, seconds to read it), for `read_parts`."""
    t1 = time.perf_counter()
    return float(value.sum()), t1 - t0, time.perf_counter() - t1


class _Reader:
    """An async consumer's side of a pass: it reads every element of what it is given.

    `watch()` before a pass starts timing the consumer's loop (`LoopStall`); `read`
    stops it as the value arrives, so the stall it returns is the arrival's (Ray's
    argument resolution, rdt's fetch), not the read's own sum (that is `read_s` of the
    breakdown, the same in every path).
    """

    stall: LoopStall | None = None

    async def watch(self) -> None:
        self.stall = LoopStall()

    async def read(self, value: torch.Tensor) -> tuple[float, float | None]:
        stall, self.stall = self.stall, None
        stalled = stall.stop() if stall is not None else None
        return float(value.sum()), stalled

    def pid(self) -> int:
        """This actor's process (a path's close waits for it to end)."""
        return os.getpid()


@rdt.remote
class Consumer(_Reader):
    """An async actor; rdt fetches its top-level refs on its loop before `read` runs."""

    async def read_parts(self, refs: list[Any]) -> tuple[float, float, float]:
        """The same pass with the ref nested: (sum, seconds to fetch, seconds to read)."""
        t0 = time.perf_counter()
        return _read_parts(t0, await rdt.fetch(refs[0]))


@rdt.remote
class IntoConsumer(_Reader):
    """An async actor that lands each value in a tensor of its own, written once (warm, as
    a model's weights are): `await rdt.fetch(ref, into=...)`, the ref passed nested so
    that the method fetches it."""

    def __init__(self) -> None:
        self.bufs: dict[int, torch.Tensor] = {}

    def _buf(self, n: int) -> torch.Tensor:
        if n not in self.bufs:
            self.bufs = {n: torch.zeros(n)}
        return self.bufs[n]

    async def _fetch(self, refs: list[Any], n: int) -> torch.Tensor:
        got: torch.Tensor = await rdt.fetch(refs[0], into=self._buf(n))
        if got.data_ptr() != self._buf(n).data_ptr():
            raise AssertionError("into= did not land in the consumer's tensor")
        return got

    async def read(self, refs: list[Any], n: int) -> tuple[float, float | None]:  # type: ignore[override]
        return await super().read(await self._fetch(refs, n))

    async def read_parts(self, refs: list[Any], n: int) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        return _read_parts(t0, await self._fetch(refs, n))


@ray.remote
class RayProducer:
    def __init__(self) -> None:
        self.kept: dict[tuple[int, str], torch.Tensor] = {}

    def make(self, n: int, shape: str) -> torch.Tensor:
        return _value(self.kept, n, shape)

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class RayConsumer(_Reader):
    """An async actor; Ray resolves its top-level refs before `read` runs."""

    async def read_parts(self, refs: list[Any]) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        return _read_parts(t0, await refs[0])


class _SharedFile:
    """A float32 tensor of `n` elements over a file in /dev/shm (MAP_SHARED), mapped once per process."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.maps: dict[int, tuple[Any, torch.Tensor]] = {}  # n -> (the mapping, a tensor over it)

    def get(self, n: int) -> torch.Tensor:
        return self.mapped(n)[1]

    def mapped(self, n: int) -> tuple[Any, torch.Tensor]:
        if n not in self.maps:
            import mmap

            fd = os.open(f"{self.prefix}-{n}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < n * 4:
                    os.ftruncate(fd, n * 4)
                mm = mmap.mmap(fd, n * 4)
                self.maps[n] = (mm, torch.frombuffer(mm, dtype=torch.float32))
            finally:
                os.close(fd)
        return self.maps[n]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def copies() -> dict[str, Callable[[Any, torch.Tensor, torch.Tensor], None]]:
    """The ways the physical limit knows to copy a private tensor into shared memory, by
    name: each `copy(mapping, tensor over it, source)`. torch's `copy_` with the threads a
    Ray worker's torch has (as every producer's own work runs), with every core's, and
    rdt_async's split copy (libc's memmove in parts on several threads, as its shm export)."""
    from rdt_async import _local

    def on_threads(n: int) -> Callable[[Any, torch.Tensor, torch.Tensor], None]:
        def copy(mm: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                dst.copy_(src)
            finally:
                torch.set_num_threads(before)
        return copy

    own, cores = torch.get_num_threads(), _cores()
    ways = {f"copy_, {own} thread{'s' if own > 1 else ''}": on_threads(own)}
    if cores != own:
        ways[f"copy_, {cores} threads"] = on_threads(cores)
    ways["memmove, split"] = lambda mm, dst, src: _local.copy_to(mm, [src], [0])
    return ways


@ray.remote
class LimitProducer:
    """The physical limit of a pass on one node: the producer does what no path can skip.

    Kept: nothing (the bytes already sit in memory the consumer maps: zero-copy sharing).
    Plain: one warm copy of the kept private tensor into memory the consumer maps (another
    process cannot see private memory: one copy, a snapshot as shm's or a live read as
    tcp's, is the least any path makes).
    Fresh: the user's own `torch.full` into fresh pages, with the threads a Ray worker's
    torch has (as every path's producer), and one warm copy into memory the consumer maps
    (a tensor born in private memory must be copied once to be shared).
    The copy is the fastest way of `copies()` at that size, picked by `prepare` before
    the size's passes (untimed), so that the limit is no slower than the copy any path's
    export makes. It returns only the size; the consumer reads every byte of the shared file.
    """

    def __init__(self, prefix: str) -> None:
        self.file = _SharedFile(prefix)
        self.filled: set[int] = set()
        self.plain: dict[int, torch.Tensor] = {}
        self.ways = copies()
        self.fastest: dict[int, str] = {}

    def prepare(self, n: int, shape: str) -> str | None:
        """Time each way to copy `n` elements into the shared file (warm, best of 3) and
        keep the fastest for this size; its name (None for the kept shape: no copy)."""
        if shape != "kept" and n not in self.fastest:
            mm, dst = self.file.mapped(n)
            src = torch.full((n,), 1.0)
            took = {}
            for name, copy in self.ways.items():
                copy(mm, dst, src)  # (warm)
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    copy(mm, dst, src)
                    times.append(time.perf_counter() - t0)
                took[name] = min(times)
            self.fastest[n] = min(took, key=lambda k: took[k])
        return self.fastest.get(n) if shape != "kept" else None

    def _copy(self, n: int, src: torch.Tensor) -> None:
        mm, dst = self.file.mapped(n)
        self.ways[self.fastest.get(n, next(iter(self.ways)))](mm, dst, src)

    def make(self, n: int, shape: str) -> int:
        if shape == "plain":
            if n not in self.plain:
                self.plain[n] = torch.full((n,), 1.0)
            self._copy(n, self.plain[n])
        elif shape == "fresh" or n not in self.filled:
            self._copy(n, torch.full((n,), 1.0))
        self.filled.add(n)
        return n

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class LimitConsumer(_Reader):
    """An async actor that reads every byte of the producer's shared file (mapped once, warm)."""

    def __init__(self, prefix: str) -> None:
        self.file = _SharedFile(prefix)

    async def read(self, n: int) -> tuple[float, float | None]:  # type: ignore[override]
        return await super().read(self.file.get(n))

    async def read_parts(self, refs: list[Any]) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        return _read_parts(t0, self.file.get(await refs[0]))


def _ray_rdt_classes(transport: str) -> tuple[Any, Any]:
    @ray.remote(enable_tensor_transport=True)
    class RdtProducer:
        def __init__(self) -> None:
            self.kept: dict[tuple[int, str], torch.Tensor] = {}

        @ray.method(tensor_transport=transport)
        def make(self, n: int, shape: str) -> torch.Tensor:
            return _value(self.kept, n, shape)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(enable_tensor_transport=True)
    class RdtConsumer:  # sync: on Ray 2.60 an async actor cannot await an RDT ref
        def watch(self) -> None:
            """No loop to watch: the same untimed call before a pass as every other path's."""

        def read(self, value: torch.Tensor) -> tuple[float, None]:
            return float(value.sum()), None  # no loop to stall: the actor waits out the arrival

        def read_parts(self, refs: list[Any]) -> tuple[float, float, float]:
            t0 = time.perf_counter()
            return _read_parts(t0, ray.get(refs[0]))

        def pid(self) -> int:
            return os.getpid()

    return RdtProducer, RdtConsumer


class _Path:
    """A producer and `fanout` consumers of one kind, and how to tear them down.

    `nested`: the consumers take the ref in a list, and the element count (`IntoConsumer`).
    """

    def __init__(self, name: str, producer: Any, consumers: list[Any], close: Callable[[], None] = lambda: None,
                 *, nested: bool = False, prepare: Callable[[int, str], dict[str, Any]] = lambda n, shape: {}):
        self.name, self.producer, self.consumers, self._close = name, producer, consumers, close
        self.nested, self.prepare = nested, prepare
        self.pids: list[int] = ray.get([producer.pid.remote(), *(c.pid.remote() for c in consumers)], timeout=120)

    def one_pass(self, n: int, shape: str, k: int = 1) -> tuple[float, float | None]:
        """(seconds from the producing call until `k` consumers have read it all, the worst
        stall of their loops while it arrived: None for sync consumers).

        Before the clock starts, one untimed call to each consumer (`watch`: an async one
        starts timing its loop there; a sync one has none to time), the same for every path.
        """
        consumers = self.consumers[:k]
        ray.get([c.watch.remote() for c in consumers], timeout=60)
        t0 = time.perf_counter()
        ref = self.producer.make.remote(n, shape)
        args = ([ref], n) if self.nested else (ref,)
        read = ray.get([c.read.remote(*args) for c in consumers], timeout=600)
        took = time.perf_counter() - t0
        if any(s != float(n) for s, _ in read):
            raise AssertionError(f"{self.name}: read {[s for s, _ in read]}, expected {float(n)} each")
        stalls = [st for _, st in read if st is not None]
        return took, max(stalls) if stalls else None

    def parts(self, n: int, shape: str) -> dict[str, float] | None:
        """One pass with the ref nested, split: the calls (producing call and export, the
        consumer's call), the fetch (resolving the ref and moving the bytes), the read."""
        t0 = time.perf_counter()
        ref = self.producer.make.remote(n, shape)
        try:
            args = ([ref], n) if self.nested else ([ref],)
            total, fetch, read = ray.get(self.consumers[0].read_parts.remote(*args), timeout=600)
        except Exception:  # a path that cannot take a nested ref: no breakdown
            return None
        took = time.perf_counter() - t0
        if total != float(n):
            raise AssertionError(f"{self.name}: read {total}, expected {float(n)}")
        return {"calls_s": max(0.0, took - fetch - read), "fetch_s": fetch, "read_s": read}

    def close(self) -> None:
        """Tear the path down, and wait until its actors' processes have ended."""
        try:
            self._close()
        finally:
            end_actors([self.producer, *self.consumers], self.pids)


REMOTE = {"num_cpus": 0, "resources": {"remote": 1}}  # the second host of `--hosts 2`


def unavailable(name: str, hosts: int = 1) -> str | None:
    """Why path `name` cannot run here (a package not installed, one host only), or None."""
    package = {"rdt nixl": "nixl", "rdt ucxx": "ucxx", "ray rdt nixl": "nixl"}.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"{package} is not installed (`pip install 'rdt_async[{package}]'` adds it)"
    if hosts == 2 and name in ("rdt shm", LIMIT):  # across hosts the limit is the network's
        return "one host only"
    return None


def _make_path(name: str, fanout: int, hosts: int = 1) -> _Path:
    """The path's actors. See `unavailable` first: it says why a path cannot run here."""
    where = REMOTE if hosts == 2 else {}
    if name == INTO:
        consumers = [IntoConsumer.options(**where).remote() for _ in range(fanout)]
        return _Path(name, _rdt_producer("auto").remote(), consumers, nested=True)
    if name.startswith("rdt "):
        transport = name[4:]
        producer = _rdt_producer(transport).remote()
        consumers = [Consumer.options(**where).remote() for _ in range(fanout if transport != "gloo" else 1)]
        if transport == "gloo":
            group = rdt.create_collective_group([producer, *consumers], backend="gloo")
            return _Path(name, producer, consumers, lambda: rdt.destroy_collective_group(group))
        return _Path(name, producer, consumers)
    if name == LIMIT:
        return _limit_path(fanout)
    if name == "ray object store":
        return _Path(name, RayProducer.remote(), [RayConsumer.options(**where).remote() for _ in range(fanout)])
    if name == "ray object store zero-copy":
        opts = {"runtime_env": ZERO_COPY_ENV}
        consumers = [RayConsumer.options(**opts, **where).remote() for _ in range(fanout)]
        return _Path(name, RayProducer.options(**opts).remote(), consumers)
    transport = name.rsplit(" ", 1)[1]
    producer_cls, consumer_cls = _ray_rdt_classes(transport)
    producer = producer_cls.remote()
    consumers = [consumer_cls.options(**where).remote() for _ in range(fanout if transport != "gloo" else 1)]
    if transport == "gloo":
        from ray.experimental.collective import create_collective_group, destroy_collective_group

        communicator = create_collective_group([producer, *consumers], backend="torch_gloo")
        return _Path(name, producer, consumers, lambda: destroy_collective_group(communicator))
    return _Path(name, producer, consumers)


def _limit_path(fanout: int) -> _Path:
    import glob
    import os
    import secrets

    prefix = f"/dev/shm/rdtbench-limit-{os.getpid()}-{secrets.token_hex(4)}"

    def unlink() -> None:
        for f in glob.glob(prefix + "-*"):
            os.unlink(f)

    def prepare(n: int, shape: str) -> dict[str, Any]:  # (untimed: the copy it will use at this size)
        copy = ray.get(producer.prepare.remote(n, shape), timeout=600)
        return {} if copy is None else {"limit_copy": copy}

    producer = LimitProducer.remote(prefix)
    return _Path(LIMIT, producer, [LimitConsumer.remote(prefix) for _ in range(fanout)], unlink, prepare=prepare)


def _ours() -> list[str]:
    return ["rdt auto", INTO, "rdt shm", "rdt tcp", "rdt nixl", "rdt ucxx", "rdt object_store", "rdt gloo"]


# The fan-out's paths that take turns with every consumer alive at once (what most readers
# compare: auto, the usual denominator, the floor); the others run one path at a time
# (8 consumers of every path at once would not fit 2 cores).
FANOUT_TOGETHER = ("rdt auto", "ray object store zero-copy", LIMIT)


def run(
    sizes: list[int],
    repeat: int,
    fanouts: tuple[int, ...] = (4, 8),
    progress: Progress | None = None,
    paths: list[str] | None = None,
    hosts: int = 1,
    shapes: tuple[str, ...] = SHAPES,
) -> list[dict[str, Any]]:
    """All paths (or `paths`), every shape of `shapes`, every size (bytes), one consumer;
    then fan-out of the largest (kept, shared).

    The one-consumer passes take the paths in turns (every path's actors alive at once,
    each round in another order: `_turns.in_turns`, a settle after each pass), so that
    each ratio compares passes of the same moment, not a path run early against one run
    late on a machine that has changed meanwhile; the paths in ALONE, whose idle actors
    burn CPU, run by themselves afterwards. Fan-out takes FANOUT_TOGETHER's paths in turns
    the same way, then each other path alone; a path's actors have ended before the next
    path's start. A path whose pass raises keeps the passes it finished (its row says
    what `broke`, or is an `error` row if no warm pass ran) and is left out from then on.
    `hosts=2`: the consumers run on the second host (see bench/_hosts.py: ray_cluster). Each row's
    `loop_stall_ms` is the worst stall of the consumers' loops while the warm passes'
    values arrived (None where the consumer is a sync actor: Ray's RDT paths).
    """
    progress = progress or Progress(False)
    rows: list[dict[str, Any]] = []
    names = paths or _ours() + list(RAY_PATHS) + [LIMIT]
    together = [n for n in names if n not in ALONE]
    groups = ([together] if together else []) + [[n] for n in names if n in ALONE]
    fanning = [n for n in names if not n.endswith("gloo")] if fanouts else []  # (a gloo path moves to its group)
    fan_together = [n for n in fanning if n in FANOUT_TOGETHER]
    fan_groups = ([fan_together] if fan_together else []) + [[n] for n in fanning if n not in FANOUT_TOGETHER]
    progress.add(len(shapes) * len(sizes) * len(groups) + len(fanouts) * len(fan_groups))
    for group in groups:
        rows += _in_turns(group, sizes, repeat, hosts, progress, shapes)
    failed = {r["case"] for r in rows if "error" in r or "skipped" in r or "broke" in r}  # not set up again
    for group in fan_groups:
        rows += _fanout([n for n in group if n not in failed], max(sizes), fanouts, repeat, hosts, progress)
    _ratios(rows)
    return rows


def _setup(name: str, fanout: int, hosts: int, progress: Progress) -> tuple[_Path | None, dict[str, Any] | None]:
    """The path's actors, or None and the row that says why it cannot run here: `skipped`
    (not installed, one host only), or `error` (it failed to set up)."""
    why = unavailable(name, hosts)
    if why is not None:
        progress.note(f"e2e {name}: not run: {why}")
        return None, {"bench": "e2e", "case": name, "hosts": hosts, "skipped": why}
    try:
        return _make_path(name, fanout, hosts), None
    except Exception as e:  # a path that cannot run here (Ray's RDT gloo across hosts) is a result too
        progress.note(f"e2e {name}: failed to set up: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None, {"bench": "e2e", "case": name, "hosts": hosts, "error": f"{type(e).__name__}: {str(e)[:500]}"}


def _set_up(names: list[str], fanout: int, hosts: int, progress: Progress) -> tuple[dict[str, _Path], list[dict[str, Any]]]:
    """Every path of `names` that can run here (closed again if a later one's setup is
    interrupted), and the rows that say why the others cannot."""
    live: dict[str, _Path] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name in names:
            path, failed = _setup(name, fanout, hosts, progress)
            if failed is not None:
                rows.append(failed)
            if path is not None:
                live[name] = path
    except BaseException:
        _close_all(live)
        raise
    return live, rows


def _close_all(live: dict[str, _Path]) -> None:
    for p in live.values():
        p.close()
    live.clear()


# Passes of 1 MiB and less take milliseconds, and their medians move by as much from run
# to run (a Ray call's jitter): they get this many times the rounds.
SMALL_BYTES, SMALL_ROUNDS = 1 << 20, 10


def _rounds(repeat: int, size: int) -> int:
    """How many warm rounds a size gets: `repeat`, or SMALL_ROUNDS times it for small sizes."""
    return repeat * SMALL_ROUNDS if size <= SMALL_BYTES else repeat


Pass = tuple[float, float | None]  # a pass's seconds, and the worst loop stall meanwhile


def _take_turns(live: dict[str, _Path], n: int, shape: str, rounds: int, k: int = 1) -> Turns[Pass]:
    """A cold pass of each path of `live`, then `rounds` rounds of warm ones, to `k`
    consumers each; a path that breaks is closed and leaves `live`."""

    def broke(name: str) -> None:
        live.pop(name).close()

    passes = {name: functools.partial(p.one_pass, n, shape, k) for name, p in live.items()}
    return take_turns(passes, rounds, broke=broke)


def turn_rows(turns: Turns[Pass], names: list[str], base: dict[str, Any], *, cold: bool = True) -> list[dict[str, Any]]:
    """One row per path of `names` ({"bench": "e2e", "case": name, **base, ...}): the
    warm passes' median (`seconds`), their worst loop stall, the cold pass (`cold`), each
    warm pass's seconds in round order (`passes_s`) and the path's place in each round
    (`turns`, 0: first; the cold round's first). A path that broke after warm passes says
    what (`broke`); one that broke before any is an `error` row."""
    rows = []
    for name in names:
        row: dict[str, Any] = {"bench": "e2e", "case": name, **base}
        warm, why = turns.warm[name], turns.why(name)
        if not warm:
            rows.append({**row, "error": why or "no warm pass ran"})
            continue
        if cold and name in turns.cold:
            row["cold_s"] = turns.cold[name][0]
        row.update(seconds=statistics.median(t for t, _ in warm), loop_stall_ms=_worst_ms(warm), passes=len(warm),
                   passes_s=[round(t, 6) for t, _ in warm], turns=turns.turns[name])
        if why is not None:
            row["broke"] = why
        rows.append(row)
    return rows


def _in_turns(names: list[str], sizes: list[int], repeat: int, hosts: int, progress: Progress,
              shapes: tuple[str, ...] = SHAPES) -> list[dict[str, Any]]:
    """One consumer per path: for each (shape, size), a cold pass of each path, then
    `repeat` rounds (`_rounds`: more for small sizes) of one warm pass of each, in turns
    (`_turns.take_turns`); then one pass of each, split (`breakdown`)."""
    live, rows = _set_up(names, 1, hosts, progress)
    try:
        if not live:  # every path of the group is missing here: its rows say why
            progress.skip(len(shapes) * len(sizes))
            return rows
        for shape in shapes:
            for size in sizes:
                n = max(1, size // 4)  # float32 elements
                with progress.step(f"e2e {shape} {human(size)}, {len(live)} paths in turns"):
                    base = {"shape": shape, "size": size, "consumers": 1, "hosts": hosts}
                    extra, failed = _prepare(live, n, shape, base)
                    rows += failed
                    ran = list(live)
                    turns = _take_turns(live, n, shape, _rounds(repeat, size))
                    for row in turn_rows(turns, ran, base):
                        if row["case"] in live:
                            row["breakdown"] = _breakdown(live[row["case"]], n, shape)
                        rows.append({**row, **extra.get(row["case"], {})})
    finally:
        _close_all(live)
    return rows


def _prepare(live: dict[str, _Path], n: int, shape: str, base: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each path's untimed preparation for (n, shape) (the limit picks its copy): what it
    adds to the path's row, and error rows for paths whose preparation failed (closed, out of `live`)."""
    extra, failed = {}, []
    for name in list(live):
        try:
            extra[name] = live[name].prepare(n, shape)
        except Exception as e:
            failed.append({"bench": "e2e", "case": name, **base, "error": f"preparing: {type(e).__name__}: {e}"[:500]})
            live.pop(name).close()
    return extra, failed


def _breakdown(path: _Path, n: int, shape: str) -> dict[str, Any] | None:
    try:
        return path.parts(n, shape)
    except Exception as e:  # (a wrong sum: the row's passes stand, the breakdown says what went wrong)
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _fanout(names: list[str], size: int, fanouts: tuple[int, ...], repeat: int, hosts: int,
            progress: Progress) -> list[dict[str, Any]]:
    """One object of `size` bytes to each of `fanouts` consumers of each path of `names`
    at once, the paths in turns (a warm-up pass of each, then `repeat` rounds)."""
    live, rows = _set_up(names, max(fanouts), hosts, progress)
    try:
        if not live:
            progress.skip(len(fanouts))
            return rows
        for k in fanouts:
            with progress.step(f"e2e kept {human(size)} to {k}, {', '.join(live)} in turns"):
                ran = list(live)
                turns = _take_turns(live, size // 4, "kept", repeat, k)
                rows += turn_rows(turns, ran, {"shape": "kept", "size": size, "consumers": k, "hosts": hosts}, cold=False)
    finally:
        _close_all(live)
    return rows


def _worst_ms(passes: list[Pass]) -> float | None:
    stalls = [st for _, st in passes if st is not None]
    return round(max(stalls) * 1e3, 3) if stalls else None


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's time over the best Ray path's time for the same shape, size and consumers
    (`vs_best_ray`), and over the physical limit's where it ran (`vs_limit`)."""
    best: dict[tuple[Any, ...], float] = {}
    limit: dict[tuple[Any, ...], float] = {}
    rows = [r for r in rows if "seconds" in r]
    for r in rows:
        key = (r["shape"], r["size"], r["consumers"])
        if r["case"] in RAY_PATHS:
            best[key] = min(best.get(key, float("inf")), r["seconds"])
        elif r["case"] == LIMIT:
            limit[key] = r["seconds"]
    for r in rows:
        key = (r["shape"], r["size"], r["consumers"])
        if best.get(key):
            r["vs_best_ray"] = r["seconds"] / best[key]
        if limit.get(key) and r["case"] != LIMIT:
            r["vs_limit"] = r["seconds"] / limit[key]


def check_shapes(spec: str) -> tuple[str, ...]:
    """`--e2e-shapes`, comma-separated (any case); all of SHAPES for none.
    Raises SystemExit naming the known shapes, before anything runs."""
    shapes = tuple(dict.fromkeys(p.strip().lower() for p in spec.split(",") if p.strip()))
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--e2e-shapes: unknown {', '.join(map(repr, unknown))}; the shapes are: {', '.join(SHAPES)}")
    return shapes or SHAPES


def check_paths(spec: str) -> list[str] | None:
    """`--e2e-paths`, comma-separated, as the path names (any case); None for all.
    Raises SystemExit naming the known paths, before anything runs."""
    known = _ours() + list(RAY_PATHS) + [LIMIT]
    paths = [" ".join(p.split()).lower() for p in spec.split(",") if p.strip()]
    unknown = [p for p in paths if p not in known]
    if unknown:
        raise SystemExit(f"--e2e-paths: unknown {', '.join(map(repr, unknown))}; the paths are: {', '.join(known)}")
    return paths or None


def check_costs_file(path: str) -> None:
    """Before a run that will merge costs into `path`: an existing file must be a cost file
    (else the run's end would fail). Raises SystemExit naming the fix."""
    import os

    from ..transports._auto import read_costs

    if os.path.exists(path):
        try:
            read_costs(path)
        except ValueError as e:
            raise SystemExit(f"--write-costs {path}: {e}: remove it, or name another file") from e


# The shape auto's costs are fitted to: a tensor the producer keeps and never shared, as
# most users return one (shm copies a snapshot of it into a segment at each return, tcp
# and nixl serve it as it is); every transport's cost comes from the same shape.
COSTS_SHAPE = "plain"


def check_costs_shapes(shapes: tuple[str, ...]) -> None:
    """Before a run with --write-costs: its shapes must include COSTS_SHAPE. Raises SystemExit naming the fix."""
    if COSTS_SHAPE not in shapes:
        raise SystemExit(f"--write-costs fits auto's costs to the {COSTS_SHAPE} shape's passes, which --e2e-shapes "
                         f"{','.join(shapes)} leaves out: add {COSTS_SHAPE} to it, or give no --e2e-shapes")


def write_costs(rows: list[dict[str, Any]], path: str) -> dict[str, list[float]]:
    """Fit `latency + bytes / bandwidth` per rdt transport to its one-consumer passes of the
    COSTS_SHAPE shape (each size's warm median); merge into `path` (JSON).

    The file is what RDT_AUTO_COSTS names for `auto` (transports/_auto.py). Passes on one
    host give "<transport>/node", on two hosts "<transport>/hosts".
    """
    import json
    import os

    from ..transports._auto import fit

    fitted: dict[str, list[float]] = {}
    mine = [r for r in rows if r["bench"] == "e2e" and "seconds" in r and r.get("shape") == COSTS_SHAPE
            and r["consumers"] == 1]
    for case in {r["case"] for r in mine if r["case"].startswith("rdt ")}:
        transport = case[4:]
        if transport == "auto" or case == INTO:
            continue
        for hosts in {r.get("hosts", 1) for r in mine}:
            points = [(r["size"], r["seconds"]) for r in mine if r["case"] == case and r.get("hosts", 1) == hosts]
            cost = fit(points)
            if cost is not None:
                fitted[f"{transport}/{'node' if hosts == 1 else 'hosts'}"] = [round(cost.latency_s, 6), round(cost.gib_s, 4)]
    data: dict[str, Any] = {}
    if os.path.exists(path):
        check_costs_file(path)
        with open(path) as f:
            data = json.load(f)
    data.setdefault("cpu", {}).update(fitted)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return fitted
