"""`gloo`: two-sided, receiver-driven transfers over standalone Gloo process groups.

Groups are standalone `ProcessGroupGloo`s over a `PrefixStore` (no global default
group), so a process may be in any number of groups at once: `host_store` and `join`
make a member's process group (NCCL's too), and record it in the membership registry
(`rdt_async._membership.groups`, also `groups` here). A transfer:

    consumer                                    producer (its `rdt` group)
    --------                                    --------
    post recvs: status, one per tensor (a block of unique tags)
    request_send({group, dst, tag, specs})   -> post sends: status HELD, tensors; wait (pool)
    wait recvs (pool): done                  <- reply (not waited for once the status says HELD)
Gloo's point-to-point `Work` has no future, so each wait runs in a bounded pool of
waiter threads and completion reaches the caller's loop through the I/O loop. The
status message makes the data self-describing, so a fetch ends when its bytes land,
not one Ray reply later. A producer that no longer holds the object sends status
FREED and zeros of the right size (so the consumer's posted receives complete), and
its reply raises ObjectFreedError. Gloo cannot cancel a posted receive: a cancelled
fetch whose receives land in the caller's `into=` buffers returns once they have landed
(at most `DRAIN_S`; then the group is aborted, so nothing writes them afterwards), and
one landing in buffers of its own returns at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import _cuda, _io
from .._errors import CollectiveGroupError, ObjectFreedError, PeerDiedError, RDTError
from .._membership import TAG_LIMIT as TAG_LIMIT
from .._membership import Group as Group
from .._membership import groups as groups
from ._base import Channel, TransferInfo, Transport, delivered, landing_buffers

HELD, FREED = 1, 2  # the status message that comes before an object's tensors
REPLY_AFTER_FAILURE_S = 10.0  # how long a failed receive waits for Ray's word on the producer
DRAIN_S = 30.0  # how long a cancelled fetch waits for receives that write caller buffers

_hosted: dict[str, Any] = {}  # rank 0's rendezvous stores, from host_store until join
_hosted_lock = threading.Lock()


def host_store(name: str, host: str) -> int:
    """Start the rendezvous store of a new group here (rank 0); return its port."""
    # TCPStore and PrefixStore are torch.distributed's, re-exported untyped from its C module.
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    with _hosted_lock:
        _hosted[name] = store
    return int(store.port)


def join(name: str, backend: str, rank: int, size: int, host: str, port: int, timeout_s: float) -> None:
    """Make this process's process group of a collective group and record it in `groups`.

    Blocks until every member joined: call it off the loop.
    Raises: CollectiveGroupError (already in a group of that name, a bad backend, no GPU).
    """
    if groups.get(name) is not None:
        raise CollectiveGroupError(f"this process is already in a group named {name!r}")
    with _hosted_lock:
        store = _hosted.pop(name, None)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore(f"rdt/{name}", store)  # type: ignore[attr-defined]
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, untyped
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [_listener_device(host, rank)]
        pg: Any = dist.ProcessGroupGloo(prefixed, rank, size, opts)
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise CollectiveGroupError("backend 'nccl' needs a CUDA GPU in every member; use backend='gloo'")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        raise CollectiveGroupError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    groups.add(Group(name, backend, rank, size, pg, store))


def leave(name: str) -> bool:
    """Leave group `name` (a store hosted for it included); False if this process was not in it."""
    with _hosted_lock:
        _hosted.pop(name, None)
    return groups.leave(name)


def _listener_device(host: str, rank: int) -> Any:
    """Gloo's listener: on GLOO_SOCKET_IFNAME's interface where set, else where `host` routes."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if iface:
        return dist.ProcessGroupGloo.create_device(interface=iface)
    return dist.ProcessGroupGloo.create_device(hostname=host if rank == 0 else _my_host(host))


def _my_host(hint: str) -> str:
    import socket

    # Bind where the store's host routes from: the address this node uses to reach it.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((hint, 9))
            return str(s.getsockname()[0])
        except OSError:
            return hint


async def wait_works(works: Sequence[Any]) -> None:
    """Wait for Gloo works in the bounded waiter pool, without blocking the loop."""

    def wait_all() -> None:
        for w in works:
            w.wait()

    await asyncio.get_running_loop().run_in_executor(_io.pool(_io.GLOO), wait_all)


@dataclass(frozen=True)
class GlooMeta:
    """The group the consumer shares with the producer, and the producer's rank in it."""

    group: str
    src: int


# What Gloo says when a peer's connection goes (its process or host died, or the group
# was aborted under the call). torch raises Gloo's failures as plain RuntimeErrors, with
# no class of their own: the text is all there is to go by.
_LOST_PEER = ("Connection closed", "Connection reset", "Read error", "Broken pipe", "abort")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc`, raised by a Gloo call, says a peer of the group went away."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LOST_PEER)


class GlooTransport(Transport[GlooMeta]):
    """Gloo point-to-point between members of one collective group (CPU tensors)."""

    name = "gloo"
    backend = "gloo"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    matches_in_order = False  # Gloo matches a send to its receive by tag
    one_sided = False
    pins_memory = False
    can_abort = False

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        return PeerDiedError if lost_peer(exc) else None

    async def receive(
        self, info: TransferInfo[GlooMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        group = groups.require(info.meta.group)
        dsts = landing_buffers(info.specs, buffers, _device(self))
        base = group.tags(len(dsts) + 1)
        status = torch.zeros(1, dtype=torch.int64, device=_device(self))
        src = info.meta.src
        request = {
            "group": group.name,
            "dst": group.rank,
            "tag": base,
            "specs": [(tuple(s.shape), s.dtype) for s in info.specs],
        }
        reply: asyncio.Future[Any] | None = None
        waiting: asyncio.Future[None] | None = None
        try:
            # Posting raises at once where the pair is already closed (a dead producer).
            works = [group.pg.recv([status], src, base)]
            works += [group.pg.recv([d], src, base + 1 + i) for i, d in enumerate(dsts) if d.numel()]
            reply = asyncio.ensure_future(channel.request_send(request))
            waiting = asyncio.ensure_future(self.wait_works(works))
            await asyncio.wait([reply, waiting], return_when=asyncio.FIRST_COMPLETED)
            if reply.done() and reply.exception() is not None:
                reply.result()  # the producer said why first: freed, died, not in the group
            try:
                await asyncio.shield(waiting)  # a cancel must not cancel it: _drain waits on it
            except Exception:
                # A receive failed: Ray's word on the producer (died) says more than Gloo's.
                await asyncio.wait({reply}, timeout=REPLY_AFTER_FAILURE_S)
                if reply.done() and not reply.cancelled() and reply.exception() is not None:
                    reply.result()
                raise
            if int(status.item()) != HELD:
                await reply  # raises ObjectFreedError
                raise ObjectFreedError(f"object {info.obj_id} was freed before it was fetched", obj_id=info.obj_id)
        except asyncio.CancelledError:
            if waiting is not None and (
                self.matches_in_order or (buffers is not None and any(d is b for d, b in zip(dsts, buffers)))
            ):
                # They write the caller's memory (not after we return), or (NCCL) the pair's
                # next transfer would meet these receives: they complete first.
                await _drain(group, waiting)
            raise
        except BaseException as exc:
            if not isinstance(exc, (asyncio.CancelledError, ObjectFreedError)):
                groups.mark_broken(group.name, f"a transfer failed: {type(exc).__name__}")
            raise
        finally:
            if reply is not None:  # the bytes are here (or the fetch ended): its reply is news to nobody
                reply.add_done_callback(_consume)  # runs soon if it is done already
        out = delivered(buffers, dsts)
        await _cuda.wait(_cuda.record(out))  # NCCL: copies into strided buffers ran on this thread's stream
        return out

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: Any, request: dict[str, Any]
    ) -> None:
        await self._send(request, tensors, HELD)

    async def _send(self, request: dict[str, Any], tensors: Sequence[torch.Tensor], state: int) -> None:
        group = groups.require(request["group"])
        dst, base = request["dst"], request["tag"]
        srcs = [t.contiguous() for t in tensors]
        works = [group.pg.send([torch.full((1,), state, dtype=torch.int64, device=_device(self))], dst, base)]
        works += [group.pg.send([t], dst, base + 1 + i) for i, t in enumerate(srcs) if t.numel()]
        await self.wait_works(works)

    async def wait_works(self, works: Sequence[Any]) -> None:
        """Wait for point-to-point works (Gloo: waiter threads, as `Work` has no future)."""
        await wait_works(works)

    async def refuse(self, obj_id: str, request: dict[str, Any]) -> None:
        """The object is gone: status FREED, and zeros to complete the consumer's receives."""
        zeros = [torch.zeros(shape, dtype=dtype, device=_device(self)) for shape, dtype in request["specs"]]
        await self._send(request, zeros, FREED)


async def _drain(group: Group, waiting: asyncio.Future[None]) -> None:
    """Wait (bounded) for a cancelled fetch's receives; abort the group if they hang."""
    done, _ = await asyncio.wait({waiting}, timeout=DRAIN_S)
    if done:
        _consume(waiting)
    else:
        groups.abort(group.name, f"a cancelled fetch's receives did not complete in {DRAIN_S:.0f} s")


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" at exit


def _device(transport: Transport[Any]) -> str:
    return "cuda" if "cuda" in transport.devices else "cpu"


class NcclTransport(GlooTransport):
    """NCCL point-to-point between members of one collective group (CUDA tensors).

    Each group's NCCL communicator runs its own streams; a transfer completes when its
    work's CUDA events have fired, which the I/O loop polls with backoff (no thread).
    `work.wait()` then makes the current stream wait on them before tensors are used.
    """

    name = "nccl"
    backend = "nccl"
    devices = ("cuda",)
    matches_in_order = True  # NCCL ignores tags: a send meets the pair's oldest posted receive

    def __init__(self) -> None:
        super().__init__()
        self._pairs: dict[tuple[str, int], asyncio.Lock] = {}

    async def receive(
        self, info: TransferInfo[GlooMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        # NCCL ignores tags and runs a pair's point-to-point ops on one stream in the
        # order they are posted: one transfer per (group, producer) at a time, so that
        # each send meets the receive it was meant for. Runs on the I/O loop only.
        lock = self._pairs.setdefault((info.meta.group, info.meta.src), asyncio.Lock())
        async with lock:
            return await super().receive(info, buffers, channel)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "NCCL needs a CUDA GPU in this process; use 'gloo' for CPU tensors"
        return None

    async def wait_works(self, works: Sequence[Any]) -> None:
        await poll_works(works)


async def poll_works(works: Sequence[Any], *, first: float = 50e-6, cap: float = 5e-3) -> None:
    """Await works by polling their completion (CUDA events) with backoff, then order streams."""
    await _cuda.poll(works, lambda w: w.is_completed(), first=first, cap=cap)
    for w in works:
        w.wait()  # NCCL: the current stream waits on the work's event; returns at once
