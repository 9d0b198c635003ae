"""Node relay: the consumers of one node share one transfer of an object from another node.

A weight sync to eight inference actors on a node would otherwise move the object over
the link eight times (Ray's object store pulls an object to a node once). The first
consumer on a node to fetch a remote CPU object claims it by binding an abstract unix
socket named after the object -- one process of the node (of its network namespace)
can hold the name, and it goes away with that process -- and reads it as any fetch
does. If other consumers of the node asked for it meanwhile, it copies it into a memfd
and hands the memfd (SCM_RIGHTS) to them, and to those who ask while the claim lasts
(RDT_RELAY_KEEP_S after the read, default 2 s); they map it copy-on-write: no copy, and
a consumer's writes stay its own. Nobody asking costs the first consumer nothing.
Both ends check that the other runs as the same user (SO_PEERCRED).

The memfd is written once and never reused: no consumer can see another object's bytes,
and its memory goes with the last mapping. When the first consumer's read fails, is
cancelled or its process dies, the others read for themselves. A relayed fetch sees the
bytes as the first consumer read them (a producer writing a kept tensor in place while
refs exist gives no other guarantee; see `wait_tensor_freed`).

Runs on: consumer. Off with RDT_RELAY=0; objects under RELAY_MIN_BYTES are not relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import select
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from . import _io
from .transports._base import TensorSpec, aligned_layout, view_in

RELAY_MIN_BYTES = 1 << 20
ALIGN = 64
# Transports that never cross nodes, or whose bytes are already in hand.
LOCAL = frozenset({"shm", "local", "inline", "none", "cuda_ipc"})


def _keep_s() -> float:
    return float(os.environ.get("RDT_RELAY_KEEP_S", "2"))


def eligible(specs: Sequence[TensorSpec], transport: str, producer_node: str, node: str) -> bool:
    """Whether a fetch of these tensors over `transport` may go through the node relay."""
    return (
        producer_node != node
        and transport not in LOCAL
        and sys.platform == "linux"
        and os.environ.get("RDT_RELAY", "1") != "0"
        and sum(s.nbytes for s in specs) >= RELAY_MIN_BYTES
        and all(torch.device(s.device).type == "cpu" for s in specs)
    )


def _layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    offsets, size = aligned_layout((s.nbytes for s in specs), ALIGN)
    return offsets, max(size, ALIGN)  # a memfd of 0 bytes cannot be mapped


def _views(mm: mmap.mmap, specs: Sequence[TensorSpec], offsets: list[int]) -> list[torch.Tensor]:
    return [view_in(mm, s, off) for s, off in zip(specs, offsets)]


def _private(fd: int, specs: Sequence[TensorSpec], offsets: list[int], size: int) -> list[torch.Tensor]:
    """Map the memfd copy-on-write: views that read its bytes and keep their own writes."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return _views(mm, specs, offsets)


def _same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of `sock` runs as our user (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


def _address(obj_id: str) -> bytes:
    return b"\0rdt-relay-" + obj_id.encode()


async def fetch(
    obj_id: str,
    specs: Sequence[TensorSpec],
    transfer: Callable[[], Awaitable[list[torch.Tensor]]],
) -> tuple[list[torch.Tensor], bool]:
    """Fetch through the node's relay: `(tensors, True)` when another consumer read them.

    `transfer()` reads the object over the network, landing it where its transport does.
    """
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(_address(obj_id))
    except OSError:
        claim.close()  # another consumer of this node holds the object, or is reading it
        got = await _ask(obj_id, specs)
        if got is not None:
            return got, True
        return await transfer(), False
    return await _serve(claim, obj_id, specs, transfer), False


async def _serve(
    claim: socket.socket,
    obj_id: str,
    specs: Sequence[TensorSpec],
    transfer: Callable[[], Awaitable[list[torch.Tensor]]],
) -> list[torch.Tensor]:
    """Read the object for this node; copy it into a memfd for the consumers that asked meanwhile.

    The transfer lands where the transport puts it, as any fetch's (so a cancel ends it as
    promptly as any); the memfd costs a copy only where another consumer waits for it.
    """
    claim.listen(128)
    claim.setblocking(False)
    server = _Server(claim, obj_id)
    _io.call_soon(server.start)
    try:
        mine = await transfer()
        if not server.asked():
            _io.call_soon(server.end)  # nobody else wants it: later askers read for themselves
            return mine
        fd, size = await _io.to_thread_finished(_publish, obj_id, mine, specs, undo=lambda made: os.close(made[0]))
    except BaseException:
        _io.call_soon(server.end)
        raise
    _io.call_soon(server.ready, fd, size)  # it closes fd when the claim ends
    return mine


def _publish(obj_id: str, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]) -> tuple[int, int]:
    """A memfd holding a copy of `tensors` at the relay's layout."""
    offsets, size = _layout(specs)
    fd = os.memfd_create(f"rdt-relay-{obj_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        for view, t in zip(_views(shared, specs, offsets), tensors):
            view.copy_(t)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


class _Server:
    """Answers the node's other consumers of one object, on the I/O loop."""

    def __init__(self, claim: socket.socket, obj_id: str) -> None:
        self.claim, self.obj_id = claim, obj_id
        self.lock = threading.Lock()  # `waiting`: filled on the I/O loop, counted by the reader
        self.waiting: list[socket.socket] = []
        self.fd, self.size = -1, 0
        self.done = False

    def asked(self) -> bool:
        """Whether another consumer waits for the object (accepted, or still in the backlog)."""
        with self.lock:
            if self.waiting:
                return True
        return bool(select.select([self.claim], [], [], 0)[0])

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.claim.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.claim.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not _same_user(conn):
                conn.close()  # another user of this host: the bytes are not theirs to map
            elif self.fd >= 0:
                self._answer(conn)
            else:
                with self.lock:
                    self.waiting.append(conn)

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.closing(conn):
            msg = json.dumps({"obj_id": self.obj_id, "size": self.size}).encode()
            with contextlib.suppress(OSError):  # the asker gave up: nothing to answer
                socket.send_fds(conn, [msg], [self.fd])

    def ready(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for conn in waiting:
            self._answer(conn)
        asyncio.get_running_loop().call_later(_keep_s(), self.close)

    def end(self) -> None:
        """End the claim with nothing to give: who asked reads for themselves (EOF)."""
        self.close()

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        asyncio.get_running_loop().remove_reader(self.claim.fileno())
        self._accept()  # who connected last still gets the answer (or EOF)
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for conn in waiting:
            conn.close()
        self.claim.close()
        if self.fd >= 0:
            os.close(self.fd)


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _ask(obj_id: str, specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
    """The object from the consumer of this node that holds it; None if it cannot give it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    fds: list[int] = []
    try:
        try:
            await loop.sock_connect(sock, _address(obj_id))
        except OSError:
            return None  # the claim ended between our bind and connect
        if not _same_user(sock):
            return None  # the name is held by another user of this host: read for ourselves
        readable = loop.create_future()
        loop.add_reader(sock.fileno(), _set_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1024, 1)
        except OSError:
            return None
        if not msg or len(fds) != 1:
            return None  # its read failed, was cancelled, or its process died
        answer: dict[str, Any] = json.loads(msg)
        offsets, size = _layout(specs)
        if answer.get("obj_id") != obj_id or answer.get("size") != size:
            return None
        return _private(fds[0], specs, offsets, size)
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
