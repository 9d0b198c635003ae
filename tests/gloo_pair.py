"""Plain processes (no Ray) in Gloo groups that are destroyed and made anew under their
name: for `test_gloo.py`, a send asked for in the first creation, served in the second;
for `test_group_lifecycle.py`, a member (`peer`) that joins and leaves as it is told,
meeting the test's own process through a TCPStore it serves (`StoreKV`, the GCS's stand-in)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rdt_async import _io
from rdt_async._membership import Group, groups
from rdt_async.transports._base import TensorSpec, TransferInfo
from rdt_async.transports.gloo import GlooMeta, GlooTransport

SHAPES = [(1000,), (7,), (5,)]


@contextlib.contextmanager
def running(producer: Callable[..., None], consumer: Callable[..., None], *args: Any) -> Iterator[tuple[Any, Any]]:
    """Run `producer` and `consumer` in two spawned processes, joined by a pipe (each
    one's first argument) and given `args` after it; yield a pipe from each (their last
    argument: what they report). Both are ended after the block."""
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    (from_producer, producer_out), (from_consumer, consumer_out) = ctx.Pipe(), ctx.Pipe()
    procs = [
        ctx.Process(target=producer, args=(a, *args, producer_out)),
        ctx.Process(target=consumer, args=(b, *args, consumer_out)),
    ]
    for p in procs:
        p.start()
    try:
        yield from_producer, from_consumer
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@contextlib.contextmanager
def spawned(target: Callable[..., None], *args: Any) -> Iterator[Any]:
    """Run `target(conn, *args)` in a spawned process; yield the other end of `conn` once
    the target said it is ready (its first message). The process is ended after the block."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, *args))
    proc.start()
    try:
        assert mine.poll(60) and mine.recv() == "ready", "the spawned process did not start"
        yield mine
    finally:
        mine.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


class StoreKV:
    """A `KV` (transports._kvstore) over a torch TCPStore on 127.0.0.1 (the test holds its server)."""

    def __init__(self, port: int, prefix: str) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        self.prefix = prefix

    def put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        existed = self.store.check([self.prefix + key])
        if overwrite or not existed:
            self.store.set(self.prefix + key, value)
        return bool(existed)

    def get(self, key: str) -> bytes | None:
        if not self.store.check([self.prefix + key]):
            return None
        return bytes(self.store.get(self.prefix + key))

    def delete(self, key: str) -> bool:
        return bool(self.store.delete_key(self.prefix + key))

    def count(self, prefix: str) -> int:
        return 0


def peer(conn: Any, port: int, timeout_s: float) -> None:
    """Rank 1 of 2 of group "g": join or leave each creation the test names (("join", c),
    ("leave", c)), answering "ok" or the error; None ends it."""
    from rdt_async.transports import gloo

    conn.send("ready")
    while (step := conn.recv()) is not None:
        verb, creation = step
        try:
            if verb == "join":
                gloo.join("g", "gloo", 1, 2, kv=StoreKV(port, f"{creation}/"), host="127.0.0.1", attempt=creation,
                          timeout_s=timeout_s)  # fmt: skip
            else:
                gloo.leave("g", creation)
            conn.send("ok")
        except Exception as exc:
            conn.send(f"{type(exc).__name__}: {exc}")


def value(fill: float) -> list[torch.Tensor]:
    return [torch.full(s, fill) for s in SHAPES]


def _join(path: str, rank: int, creation: str) -> None:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=15)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.FileStore(path, 2), rank, 2, opts)
    groups.add(Group("g", "gloo", rank, 2, pg, None, creation=creation))


def producer(conn: Any, first: str, second: str, out: Any) -> None:
    t = GlooTransport()
    _join(first, 0, "one")
    stale = conn.recv()  # the request of fetch 1 (object OLD), left unserved: a busy producer
    conn.recv()
    groups.leave("g")
    _join(second, 0, "two")  # the group destroyed and made again under its name
    conn.recv()
    # The old request served at last, as `rdt__send` does: the group looked up by name.
    old = _io.start(t.send_multiple_tensors("OLD", value(111.0), None, stale))
    time.sleep(0.5)
    conn.send("served")
    request = conn.recv()  # fetch 2 (object NEW)
    new = _io.start(t.send_multiple_tensors("NEW", value(222.0), None, request))
    try:
        old.result(timeout=5)
        said = "sent"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    out.send(said)
    new.result(timeout=5)


class _Channel:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def request_send(self, request: Any) -> Any:
        self.conn.send(request)
        await asyncio.sleep(3600)  # (the bytes are what counts here, not the reply)


def _info(obj_id: str) -> TransferInfo[GlooMeta]:
    return TransferInfo(obj_id, tuple(TensorSpec.of(x) for x in value(0.0)), GlooMeta("g", 0), producer_pid=0)


def consumer(conn: Any, first: str, second: str, out: Any) -> None:
    t = GlooTransport()
    _join(first, 1, "one")

    async def given_up() -> None:
        task = asyncio.ensure_future(t.receive(_info("OLD"), None, _Channel(conn)))
        await asyncio.sleep(0.5)
        task.cancel()  # the caller's deadline: its own buffers, so it returns at once
        try:
            await task
        except asyncio.CancelledError:
            pass

    _io.start(given_up()).result()
    conn.send("made anew")
    groups.leave("g")
    _join(second, 1, "two")
    conn.send("go")
    conn.recv()  # the old request was served
    got = _io.start(asyncio.wait_for(t.receive(_info("NEW"), None, _Channel(conn)), 15)).result()
    out.send([float(x[0]) for x in got])


# -- a refusal whose word comes before its zeros ------------------------------------------

BIG = (1 << 17,)  # 512 KiB: received alone, straight into the caller's buffer


def producer_freed(conn: Any, path: str, out: Any) -> None:
    t = GlooTransport()
    _join(path, 0, "one")
    request = conn.recv()
    time.sleep(0.5)  # the consumer heard "freed" already (a busy producer's zeros come late)
    _io.start(t.refuse("GONE", request)).result(timeout=20)
    conn.recv()


class _Freed:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def request_send(self, request: Any) -> Any:
        from rdt_async._errors import ObjectFreedError

        self.conn.send(request)
        raise ObjectFreedError("object GONE was freed before it was fetched", obj_id="GONE")


def consumer_freed(conn: Any, path: str, out: Any) -> None:
    t = GlooTransport()
    _join(path, 1, "one")
    into = [torch.full(BIG, -1.0)]
    info = TransferInfo("GONE", (TensorSpec.of(into[0]),), GlooMeta("g", 0), producer_pid=0)
    try:
        _io.start(t.receive(info, into, _Freed(conn))).result(timeout=60)
        said = "received"
    except Exception as exc:
        said = type(exc).__name__
    when_it_ended = float(into[0][-1])
    time.sleep(1.5)
    conn.send("done")
    out.send((said, when_it_ended, float(into[0][-1])))
