"""`NixlTransport`: the Transport interface over this process's agent and its parts.

What a fetch does, in order: check that the producer may be alive (a READ posted to a
dead agent leaks inside NIXL), connect (`Peers`), register the destination (caller
buffers when given) for the length of the fetch, READ the tensors, then the liveness
slot. A READ that fails as a disconnect from a live producer may be the work of
another object's free on the same connection: the liveness slot is then read over a
fresh connection, and the object read again if it is still held. Objects up to
BOUNCE_BYTES bound for CPU land in a bounce chunk and are copied out; from a connected
producer on this host they are read on the caller's thread (`receive_nowait`), with no
hop through the I/O loop.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ... import _alloc, _cuda, _io
from ..._errors import ObjectFreedError, PeerDiedError, TransportUnavailableError
from .. import _ucx
from .._base import Channel, TransferInfo, Transport, copy_into, local_device, pid_alive
from ._agent import Agent, import_reason
from ._liveness import Slots, check_slot
from ._memory import Key, Registrations, dev_index, mem_type
from ._meta import NixlMeta
from ._peers import Peers
from ._poller import Poller
from ._producer import Exports
from ._scratch import BOUNCE_BYTES, Scratch
from ._xfer import Read, post, post_now

ALIGN = 64  # offsets of tensors that share a fetched block
# How long a fetch that lost its connection to a live producer may take to ask it anew
# whether the object was freed.
RECHECK_S = 5.0


class _Here:
    """This process's agent and everything registered with it (made once per process)."""

    def __init__(self, host: str) -> None:
        self.agent = agent = Agent()
        self.slots = Slots(agent)
        self.scratch = Scratch(agent)
        self.memory = Registrations(agent)
        self.peers = Peers(agent)
        self.exports = Exports(agent, self.memory, self.slots, host)
        self.poller = Poller(agent, busy=lambda: len(self.memory) > 0)


class NixlTransport(Transport[NixlMeta]):
    """One-sided NIXL READs (CPU and CUDA tensors; same node over CMA/CUDA IPC, or RDMA/TCP)."""

    name = "nixl"
    devices = ("cpu", "cuda")
    one_sided = True
    cross_device_buffers = True

    def __init__(self) -> None:
        self._here: _Here | None = None
        self._making = threading.Lock()  # one process's agent is made once
        self._host = socket.gethostname()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return import_reason() or _ucx.conflict("nixl")

    # -- what tests and operators look at --------------------------------------------

    @property
    def registrations(self) -> int:
        """Return how many storages this process has registered with NIXL now."""
        here = self._current()
        return 0 if here is None else len(here.memory)

    @property
    def registered_bytes(self) -> int:
        here = self._current()
        return 0 if here is None else here.memory.nbytes

    # -- the agent -------------------------------------------------------------------

    def _current(self) -> _Here | None:
        here = self._here
        return here if here is not None and here.agent.pid == os.getpid() else None

    def _get(self) -> _Here:
        """Return this process's agent and parts, making them (~0.5 s) on first use. Blocking."""
        here = self._current()
        if here is not None:
            return here
        with self._making:
            if self._current() is None:
                reason = import_reason()
                if reason is not None:
                    raise TransportUnavailableError(f"transport 'nixl' is unavailable: {reason}")
                _ucx.claim("nixl")
                self._here = _Here(self._host)
            assert self._here is not None
            return self._here

    def agent(self) -> Agent:
        """Return this process's agent, creating it (~0.5 s) on first use. Blocking."""
        return self._get().agent

    def warm_up(self) -> None:
        self._get()

    async def _get_async(self) -> _Here:
        here = self._current()
        return here if here is not None else await _io.to_thread(self._get)

    # -- producer --------------------------------------------------------------------

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> NixlMeta:
        here = self._get()
        meta = here.exports.prepare(obj_id, tensors)
        here.poller.ensure()
        return meta

    def garbage_collect(self, obj_id: str, meta: NixlMeta) -> None:
        here = self._current()
        if here is not None:
            here.exports.collect(obj_id)

    # -- consumer --------------------------------------------------------------------

    async def receive(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        meta = info.meta
        here = await self._get_async()
        for again in (False, True):
            epoch = None
            try:
                if not _alive(meta):  # checked first: a READ posted to a dead agent leaks inside NIXL
                    raise _died(info)
                remote = await here.peers.connect(meta)
                epoch = here.peers.epoch(meta.agent)
                out = await self._read_object(here, remote, info, buffers)
                break
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if _is_disconnect(exc):
                    await here.peers.forget(meta.agent, epoch)
                    # One connection serves every read from that producer: a read of
                    # another object, freed under it, can break it for this one too.
                    if not isinstance(exc, PeerDiedError) and _alive(meta) and not again:
                        if await self._still_held(here, info, exc):
                            continue  # read again, over the fresh connection
                if not isinstance(exc, (ObjectFreedError, PeerDiedError)) and not _alive(meta):
                    raise _died(info) from exc
                raise
        if buffers is None:
            return out
        strided = [(b, o) for b, o in zip(buffers, out) if b is not o]
        if strided:  # caller buffers that were not contiguous received a temporary
            # Off the caller's thread: finished on return (the caller's streams do not order against ours).
            await _io.to_thread_finished(_cuda.settled, copy_into, [b for b, _ in strided], [o for _, o in strided])
        return list(buffers)

    async def _read_object(
        self, here: _Here, remote: str, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """READ the tensors, then the liveness slot; raise ObjectFreedError if it changed."""
        meta = info.meta
        agent, scratch = here.agent, here.scratch
        out, dsts = _destinations(info, buffers)
        # Device memory just allocated here may still be in use by work queued on this
        # thread's streams (the caching allocator hands it out again); NIXL writes it
        # outside any stream. (Caller buffers were waited for on the caller's streams.)
        await _cuda.wait(_cuda.record(out))
        pairs = [(d, s) for d, s in zip(dsts, meta.descs) if s is not None]
        bounce = scratch.bounce.take() if _fits_bounce(pairs) else -1
        lands = _bounce_views(scratch, bounce, pairs) if bounce >= 0 else [d for d, _ in pairs]
        landing, lslot = _take_landing(scratch)
        keys: list[Key] = []
        try:
            keys = await here.memory.register_all((lands if bounce < 0 else []) + ([lslot] if landing < 0 else []))
            error: Exception | None = None
            for group in _by_device([(d, s) for d, (_, s) in zip(lands, pairs)]):
                try:
                    await post(agent, remote, Read(
                        [(d.data_ptr(), s[1], dev_index(d)) for d, s in group],
                        [s[:3] for _, s in group],
                        mem_type(group[0][0]), group[0][1][3],
                    ))
                except Exception as exc:  # a read of freed memory can fail: ask the slot
                    error = exc
                    break
            lslot.zero_()
            try:
                await post(agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]))
            except Exception:
                if error is not None:
                    raise error from None
                raise
            check_slot(lslot, info, error)
            if error is not None:
                raise error
            if bounce >= 0:
                copy_into([d for d, _ in pairs], lands)
        finally:
            scratch.landing.give(landing)
            scratch.bounce.give(bounce)
            if keys:
                here.memory.release(keys)
        return out

    async def _still_held(self, here: _Here, info: TransferInfo[NixlMeta], cause: BaseException) -> bool:
        """Read the liveness slot over a fresh connection: True if the object is still held.

        A READ of memory the producer has unmapped (a `free()` racing the read past the
        linger) fails its UCX endpoint for good: NIXL reports the producer disconnected,
        and the slot cannot be read over that endpoint any more. Raises ObjectFreedError
        (from `cause`) if the slot changed; any other failure here gives False, and the
        caller's error stands.
        """
        meta = info.meta
        landing, lslot = _take_landing(here.scratch)
        keys: list[Key] = []
        freed: ObjectFreedError | None = None
        held, epoch = False, None
        try:
            async with asyncio.timeout(RECHECK_S):
                keys = await here.memory.register_all([lslot] if landing < 0 else [])
                remote = await here.peers.connect(meta)
                epoch = here.peers.epoch(meta.agent)
                lslot.zero_()
                await post(here.agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]))
            check_slot(lslot, info)
            held = True
        except ObjectFreedError as exc:
            freed = exc
        except Exception as exc:
            if _is_disconnect(exc):
                await here.peers.forget(meta.agent, epoch)
        finally:
            here.scratch.landing.give(landing)
            if keys:
                here.memory.release(keys)
        if freed is not None:
            raise freed from cause
        return held

    def receive_nowait(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """Read a small CPU object of a connected producer on this host, on this thread.

        Under CMA the READ completes inside `transfer()`, so this costs no hop through the
        I/O loop. Anything else (a busy agent, no free bounce chunk, a READ NIXL leaves in
        progress, an error) returns None and the fetch takes the usual path; a READ left in
        progress is finished and released on the I/O loop.
        Raises: ObjectFreedError if the liveness slot says the object is gone.
        """
        meta = info.meta
        here = self._current()
        remote = None if here is None else here.peers.remote(meta.agent)
        if (
            here is None or remote is None or meta.host != self._host
            or any(d is not None and d[3] != "DRAM" for d in meta.descs)
            or (buffers is not None and any(b.device.type != "cpu" for b in buffers))
            or not _alive(meta)  # the usual path says so
        ):
            return None
        agent, scratch = here.agent, here.scratch
        out, dsts = _destinations(info, buffers)
        pairs = [(d, s) for d, s in zip(dsts, meta.descs) if s is not None]
        bounce = scratch.bounce.take() if _fits_bounce(pairs) else -1
        if bounce < 0:
            return None
        landing, lslot = _take_landing(scratch)
        if landing < 0 or not agent.lock.acquire(blocking=False):
            scratch.landing.give(landing)
            scratch.bounce.give(bounce)
            return None

        def give_back() -> None:
            scratch.landing.give(landing)
            scratch.bounce.give(bounce)

        handed_off = False  # then the I/O loop gives bounce and landing back
        try:
            here.peers.load_now(meta)
            lands = _bounce_views(scratch, bounce, pairs)
            local = [(b.data_ptr(), s[1], 0) for b, (_, s) in zip(lands, pairs)]
            if pairs and not post_now(agent, remote, Read(local, [s[:3] for _, s in pairs]), give_back):
                handed_off = True
                return None
            lslot.zero_()
            if not post_now(agent, remote, Read([(lslot.data_ptr(), 8, 0)], [(meta.slot, 8, 0)]), give_back):
                handed_off = True
                return None
            check_slot(lslot, info)
            copy_into([d for d, _ in pairs], lands)
        except ObjectFreedError:
            raise
        except Exception:  # the usual path reads again and reports what is wrong
            return None
        finally:
            agent.lock.release()
            if not handed_off:
                give_back()
        if buffers is None:
            return out
        return copy_into(buffers, out) if any(b is not o for b, o in zip(buffers, out)) else list(buffers)


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ in ("nixlRemoteDisconnectError", "nixlNotAllowedError") or isinstance(
        exc, PeerDiedError
    )


def _died(info: TransferInfo[NixlMeta]) -> PeerDiedError:
    meta = info.meta
    return PeerDiedError(
        f"nixl fetch of {info.obj_id}: the producer (pid {meta.pid} on {meta.host}) died", obj_id=info.obj_id
    )


def _alive(meta: NixlMeta) -> bool:
    """Say whether the producer may be alive (only checkable on its own host)."""
    return meta.host != socket.gethostname() or pid_alive(meta.pid)


def _fits_bounce(pairs: list[tuple[torch.Tensor, Any]]) -> bool:
    """Say whether a read this small lands in CPU memory (then it goes through a bounce chunk)."""
    return sum(-(-s[1] // ALIGN) * ALIGN for _, s in pairs) <= BOUNCE_BYTES and all(
        d.device.type == "cpu" for d, _ in pairs
    )


def _bounce_views(scratch: Scratch, i: int, pairs: list[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
    chunk, off, out = scratch.bounce.view(i), 0, []
    for _, s in pairs:
        out.append(chunk[off : off + s[1]])
        off += -(-s[1] // ALIGN) * ALIGN
    return out


def _take_landing(scratch: Scratch) -> tuple[int, torch.Tensor]:
    i = scratch.landing.take()
    if i < 0:
        return -1, torch.zeros(1, dtype=torch.int64)  # registered for this fetch only
    return i, scratch.landing.view(i)


def _destinations(
    info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return the tensors to hand back and, as flat bytes, where each READ lands.

    Without caller buffers, the tensors of one device are views of one block: one
    registration per fetch instead of one per tensor.
    """
    if buffers is None:
        out = _views_of_blocks(info.specs)
    else:
        out = [
            b if b.is_contiguous() else torch.empty(spec.shape, dtype=spec.dtype, device=b.device)
            for b, spec in zip(buffers, info.specs)
        ]
    dsts = [t.reshape(-1).view(torch.uint8) if t.numel() else t for t in out]
    return out, dsts


def _views_of_blocks(specs: Sequence[Any]) -> list[torch.Tensor]:
    """Allocate one byte block per device and return each spec's tensor as a view of it."""
    offsets, sizes = [], {}
    for spec in specs:
        device = local_device(spec.device)
        offsets.append((device, sizes.get(device, 0)))
        sizes[device] = sizes.get(device, 0) + -(-spec.nbytes // ALIGN) * ALIGN
    blocks = {d: _alloc.empty((n,), torch.uint8, d) for d, n in sizes.items()}  # CPU: reused, warm
    out = []
    for spec, (device, off) in zip(specs, offsets):
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
        else:
            out.append(blocks[device][off : off + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out


def _by_device(pairs: list[tuple[torch.Tensor, Any]]) -> list[list[tuple[torch.Tensor, Any]]]:
    """Group reads by (local device, remote memory): one NIXL request per group."""
    groups: dict[Any, list[tuple[torch.Tensor, Any]]] = {}
    for d, s in pairs:
        groups.setdefault((str(d.device), s[3], s[2]), []).append((d, s))
    return list(groups.values())
