"""The transport contract harness: a transport between two plain processes, no Ray.

The producer runs in a process of its own (forked from a forkserver) and answers commands over a Pipe; the consumer
is the calling process, with a `PipeChannel` standing in for the actor call that the
core makes to a producer's `rdt` group. The same harness runs on a GPU machine that
cannot carry Ray.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import threading
from typing import Any

import torch
from probes import LagProbe

from rdt_async import _cuda, _io
from rdt_async._errors import ObjectFreedError, PeerDiedError, translating
from rdt_async.transports import _net, _registry
from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo


def make_value(obj_no: int, device: str, sizes: tuple[int, ...] = (1000, 7, 0)) -> list[torch.Tensor]:
    """Deterministic tensors for object number `obj_no` (the consumer rebuilds them)."""
    g = torch.Generator().manual_seed(obj_no)
    out = [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate(sizes)]
    out.append(torch.arange(12, dtype=torch.int32).reshape(3, 4).t())  # non-contiguous
    out.append(torch.tensor([True, False]))
    out.append(torch.linspace(0, 1, 5).to(torch.bfloat16))
    return [t.to(device) for t in out]


def _send_out_of_band(conn: Any, msg: Any) -> None:
    """Send with large buffers (NumPy arrays) out of band, as Ray does: no pickled copy.

    Their bytes follow the message raw on the pipe's socket, read by `_recv` straight
    into fresh memory with the GIL released (`Connection.recv_bytes` gathers them in a
    BytesIO and copies that, holding the GIL: 64 MiB of fresh pages held the consumer's
    loop 56 ms, charged to the transport under test).
    """
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    conn.send(("oob", data, [r.nbytes for r in raws]))
    for raw in raws:
        while raw:
            raw = raw[os.write(conn.fileno(), raw) :]


def _recv(conn: Any) -> Any:
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "oob":
        _, data, sizes = msg
        buffers = []
        for size in sizes:
            buf = torch.empty(size, dtype=torch.uint8).numpy()  # not touched here: the kernel's read faults it in
            view, got = memoryview(buf), 0
            while got < size:
                n = os.readv(conn.fileno(), [view[got:]])
                if n == 0:
                    raise EOFError("the producer closed the pipe mid-message")
                got += n
            buffers.append(buf)
        return pickle.loads(data, buffers=buffers)
    return msg


def _make_late(obj_no: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """`make_value` on CUDA, written by a side stream behind ~0.1 s of GPU time.

    The producer returns while the kernels are still queued, as a method that computes
    on its current stream does; the core's `produce` then waits for them (`_cuda.settle`).
    """
    want = make_value(obj_no, "cuda", sizes)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = [torch.zeros_like(t) for t in want]
        torch.cuda._sleep(200_000_000)
        for o, w in zip(out, want):
            o.copy_(w)
        _cuda.settle(out)  # as `_produce.produce` does, on the producing thread
    return out


def _producer_main(conn: Any, transport_name: str, device: str, node_ip: str | None) -> None:
    _net.set_node_ip(node_ip)  # (a process of this node advertises the address the consumer's Ray session knows it by)
    transport = _registry.transport(transport_name)
    objects: dict[str, tuple[list[torch.Tensor], Any]] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        op = msg[0]
        try:
            if op in ("make", "make_late"):
                _, obj_no, sizes = msg
                if op == "make":
                    tensors = make_value(obj_no, device, sizes)
                else:
                    tensors = _make_late(obj_no, sizes)
                obj_id = f"obj{obj_no}-{os.urandom(4).hex()}"
                meta = transport.prepare(obj_id, tensors)
                objects[obj_id] = (tensors, meta)
                specs = tuple(TensorSpec.of(t) for t in tensors)
                conn.send(("ok", TransferInfo(obj_id, specs, meta, producer_pid=os.getpid())))
            elif op == "send":
                _, obj_id, request = msg
                if obj_id not in objects:
                    raise ObjectFreedError(f"object {obj_id} was freed", obj_id=obj_id)
                tensors, meta = objects[obj_id]
                reply = _io.start(transport.send_multiple_tensors(obj_id, tensors, meta, request)).result()
                _send_out_of_band(conn, ("ok", reply))
            elif op == "free":
                tensors, meta = objects.pop(msg[1])
                transport.garbage_collect(msg[1], meta)
                conn.send(("ok", None))
            elif op == "pid":
                conn.send(("ok", os.getpid()))
            elif op == "exit":
                for obj_id, (_, meta) in objects.items():
                    transport.garbage_collect(obj_id, meta)
                conn.send(("ok", None))
                break
        except Exception as exc:  # report to the consumer, keep serving
            conn.send(("err", exc))


def _context() -> Any:
    """Producers fork from a server that imported torch and rdt_async once.

    A spawned interpreter imports them anew for every producer (3-4 CPU-seconds each);
    a fork of the server does not. The server imports no transport's package (nixl,
    ucxx load theirs in the producer), initializes no CUDA and starts no thread: each
    producer starts as clean as a spawned one. (The server is started with the
    interpreter's own sys.path, not this process's: it can preload only installed
    packages and PYTHONPATH's, not this harness.)
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "rdt_async"])
    return ctx


class Producer:
    """A producer process for one transport, driven from the consumer (this process)."""

    def __init__(self, transport: str, device: str = "cpu") -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        # Where the consumer is in a Ray session (a test module before this one started the
        # cluster), its UCX keeps to the interface of Ray's node IP: the producer advertises
        # that address, as the workers of a node do, not its route out.
        node_ip = _net._node_ip
        self.proc = ctx.Process(target=_producer_main, args=(child, transport, device, node_ip), daemon=True)
        self.proc.start()
        child.close()
        self._lock = threading.Lock()
        self.transport = transport

    def call(self, *msg: Any) -> Any:
        with self._lock:
            self.conn.send(msg)
            try:
                status, value = _recv(self.conn)
            except (EOFError, ConnectionError) as exc:
                raise PeerDiedError(f"producer process died during {msg[0]}") from exc
        if status == "err":
            raise value
        return value

    def make(self, obj_no: int, sizes: tuple[int, ...] = (1000, 7, 0)) -> TransferInfo[Any]:
        return self.call("make", obj_no, sizes)

    def channel(self, obj_id: str) -> PipeChannel:
        return PipeChannel(self, obj_id)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except Exception:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class PipeChannel:
    """Stands in for the core's actor call to the producer's `rdt` group."""

    def __init__(self, producer: Producer, obj_id: str) -> None:
        self._producer, self._obj_id = producer, obj_id

    async def request_send(self, request: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            None, self._producer.call, "send", self._obj_id, request
        )


MAX_LAG = 0.05  # the consumer's loop may be late by this much at most during a fetch


async def fetch(producer: Producer, info: TransferInfo[Any], buffers: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Fetch like the core does, and fail if the transfer blocked this process's loop."""
    transport = _registry.transport(producer.transport)
    await asyncio.to_thread(transport.warm_up)  # a first use may load libraries (GIL held): not measured
    probe = LagProbe()
    probe.start()
    try:
        with translating(f"{transport.name} fetch of {info.obj_id}", info.obj_id, transport=transport):  # as the core does
            now = transport.receive_nowait(info, buffers)
            if now is not None:
                return now
            await _cuda.wait(_cuda.record(buffers or ()))  # as the core does before a transfer writes
            request = FetchRequest.start(transport, info, buffers=buffers, channel=producer.channel(info.obj_id))
            tensors = await request.wait()
    finally:
        lag = await asyncio.shield(probe.stop())
    assert lag < MAX_LAG, f"{transport.name} blocked the consumer's loop for {lag * 1000:.0f} ms: {probe.report()}"
    return tensors
