"""`NixlTransport`: the Transport interface over this process's agent and its parts.

What a fetch does, in order: check that the producer may be alive (a READ posted to a
dead agent leaks inside NIXL), connect (`Peers`), then run a `ReadPlan`. A READ that
fails as a disconnect from a live producer may be the work of another object's free on
the same connection: the liveness slot is then read over a fresh connection, and the
object read again if it is still held. Small CPU objects of a connected producer on
this host are read on the caller's thread (`receive_nowait`) with the same plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import ClassVar

import torch

from ... import _cuda, _io
from ..._errors import (
    BackendError,
    ObjectFreedError,
    PeerDiedError,
    RDTError,
    TransferAbortedError,
    TransportUnavailableError,
)
from ..._local import copy_into, pid_alive
from .. import _ucx
from .._base import Channel, Cost, StillWriting, TransferInfo, Transport, Unreachable, WarmAt
from ._agent import Agent, import_reason
from ._check import check
from ._liveness import Slots
from ._memory import Key, Registrations
from ._meta import NixlMeta
from ._peers import Peers
from ._plan import ReadPlan, written_late
from ._poller import Poller
from ._producer import Exports
from ._scratch import Scratch
from ._xfer import ReadStalled

_log = logging.getLogger("rdt_async")
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
        self.peers = Peers(agent, gone=_gone)
        self.exports = Exports(agent, self.memory, self.slots, host)
        self.poller = Poller(agent, busy=self.memory.busy)  # a user's registration alone is not work


@dataclasses.dataclass(frozen=True)
class _Held:
    """What `NixlTransport.register_memory` returns: the storages it holds, in this process."""

    pid: int
    keys: tuple[Key, ...]


class NixlTransport(Transport[NixlMeta]):
    """One-sided NIXL READs (CPU and CUDA tensors; same node over CMA/CUDA IPC, or RDMA/TCP)."""

    name = "nixl"
    devices = ("cpu", "cuda")
    one_sided = True
    cross_device_buffers = True
    registers_memory = True
    clashes_with = frozenset({"ucxx"})  # (each brings its own UCX: see transports/_ucx.py)
    auto_prepares = True  # where it is the cheapest (GPU objects for other nodes; CPU ones on RDMA)
    auto_costs: ClassVar[Mapping[str, Cost]] = {
        "cpu/node": Cost(0.0043, 1.98),
        "cpu/hosts": Cost(0.0072, 0.86),  # over TCP: tcp's own streams are faster
        "gpu/node": Cost(0.00117, 1900.0),  # (fitted with cuda_ipc's, see there)
        "gpu/hosts": Cost(0.004, 10.0),  # not measured (one GPU)
    }

    def __init__(self) -> None:
        self._here: _Here | None = None
        self._making = threading.Lock()  # one process's agent is made once
        self._host = socket.gethostname()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return import_reason() or _ucx.conflict("nixl")

    @classmethod
    def warm_at_creation(cls) -> WarmAt:
        """Its agent takes ~0.5 s to make: an `rdt.remote` actor makes it at creation where
        `auto` may take nixl (RDT_WARM_NIXL: 1 always, 0 never). Not where UCXX is
        installed: the first of NIXL and UCXX to load owns the process's UCX, and loading
        NIXL unasked would keep a later `ucxx` fetch out (set RDT_WARM_NIXL=1 where auto
        is what matters)."""
        setting = os.environ.get("RDT_WARM_NIXL", "")
        if setting in ("0", "1"):
            return "always" if setting == "1" else "never"
        if not _installed("nixl") or _installed("ucxx"):
            return "never"
        return "where auto may take it"

    @classmethod
    def address(cls, meta: object) -> str | None:
        """The producer's agent: its name and a digest of its connection metadata. READs
        from one producer that stall take nixl away from no other producer of its node
        (nor does a ref naming a live agent with other connection metadata)."""
        if not isinstance(meta, NixlMeta) or type(meta.agent) is not str or type(meta.conn) is not bytes:
            return None
        return f"{meta.agent[:100]}/{hashlib.sha256(meta.conn).hexdigest()[:16]}"

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        errors = _native_errors()
        if isinstance(exc, errors.disconnected):
            return PeerDiedError
        return BackendError if isinstance(exc, errors.every) else None

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

    def memory_stats(self) -> dict[str, int]:
        """Return the storages and bytes registered now, those a user holds, and the calls so far."""
        here = self._current()
        if here is None:
            return {
                "storages": 0, "bytes": 0, "held_storages": 0, "held_bytes": 0,
                "registered_total": 0, "deregistered_total": 0,
            }
        return here.memory.stats()

    # -- registered ahead of time (rdt.register_memory) -------------------------------

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> _Held:
        """Register each tensor's storage with this process's agent until `deregister_memory`.

        Objects made of these tensors or their views, and fetches into them, then find
        the storage registered (the refcount in `_memory`) and call NIXL for nothing.
        Runs on: either side, off the event loop. Blocking: creates the agent on first use.
        """
        here = self._get()
        return _Held(here.agent.pid, tuple(here.memory.hold(tensors)))

    def deregister_memory(self, token: _Held) -> None:
        here = self._current()
        if here is not None and token.pid == here.agent.pid:
            here.memory.unhold(token.keys)

    def peer_gone(self, node_id: str, pid: int) -> None:
        """Drop the connection to a producer a fetch found dead (of any host: this one's
        sweep sees only its own host's processes go)."""
        here = self._current()
        if here is not None:
            _io.call_soon(here.peers.lost, node_id, pid)

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
        return here if here is not None else await _io.to_thread(self._get, purpose=_io.CALLS)

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
        check(info, info.producer_pid)  # before anything reaches NIXL
        late = None if buffers is None else written_late(buffers)
        if late is not None:
            raise StillWriting(
                f"nixl fetch of {info.obj_id}: into= tensor {late} takes a READ of an earlier fetch that NIXL could not "
                "end (cancelled or stalled, its producer unreachable): NIXL may still write it, now or later. Give "
                "those buffers up and fetch into new ones, or without into="
            )
        meta = info.meta
        here = await self._get_async()
        here.peers.hold(meta.agent)  # not dropped as idle while this reads
        try:
            out = await self._read_held(here, info, buffers)
        finally:
            here.peers.release(meta.agent)
        if buffers is None:
            return out
        strided = [(b, o) for b, o in zip(buffers, out) if b is not o]
        if strided:  # caller buffers that were not contiguous received a temporary
            # Off the caller's thread: finished on return (the caller's streams do not order against ours).
            await _io.to_thread_finished(_cuda.settled, copy_into, [b for b, _ in strided], [o for _, o in strided])
        return list(buffers)

    async def _read_held(
        self, here: _Here, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """Connect and read; once more over a fresh connection where a broken one may be
        another object's doing."""
        meta = info.meta
        for again in (False, True):
            epoch = None
            try:
                if not _alive(meta):  # checked first: a READ posted to a dead agent leaks inside NIXL
                    raise _died(info)
                remote = await here.peers.connect(meta, info.producer_node)
                epoch = here.peers.epoch(meta.agent)
                return await self._read_object(here, remote, info, buffers, epoch)
            except (asyncio.CancelledError, StillWriting):
                raise  # (StillWriting: its buffers may change yet, so no READ lands in them again)
            except BaseException as exc:
                # A READ of another object that stalled, or was cancelled and would not end,
                # cuts off the connection this one used too: its READ then ends in an error.
                cut_off = epoch is not None and here.peers.epoch(meta.agent) != epoch
                if _is_disconnect(exc) or (cut_off and isinstance(exc, (TransferAbortedError, *_native_errors().every))):
                    if isinstance(exc, ReadStalled) and not again:  # (a second stall is the fetch's error)
                        _log.warning("rdt_async: %s; reading %s again over a fresh connection", exc, info.obj_id)
                    await here.peers.forget(meta.agent, epoch)
                    # One connection serves every read from that producer: a read of
                    # another object, freed under it, can break it for this one too.
                    if not isinstance(exc, PeerDiedError) and _alive(meta) and not again:
                        if await self._still_held(here, info, exc):
                            continue  # read again, over the fresh connection
                if not isinstance(exc, (ObjectFreedError, PeerDiedError)) and not _alive(meta):
                    raise _died(info) from exc
                if isinstance(exc, ReadStalled):  # over the fresh connection too: no READ from this producer ends
                    raise exc from Unreachable(
                        f"nixl READs from {meta.agent} stall: none ended over a fresh connection either"
                    )  # (`auto` takes another path for it: see `Unreachable`)
                raise
        raise AssertionError("unreachable: the second try returns or raises")

    async def _read_object(
        self, here: _Here, remote: str, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None,
        epoch: int | None,
    ) -> list[torch.Tensor]:
        """READ the tensors, then the liveness slot; raise ObjectFreedError if it changed.

        A cancelled READ NIXL cannot end otherwise ends by dropping connection `epoch`."""
        plan = ReadPlan(info, buffers, here.scratch, here.memory, same_host=info.meta.host == self._host)
        try:
            # Device memory just allocated here may still be in use by work queued on this
            # thread's streams (the caching allocator hands it out again); NIXL writes it
            # outside any stream. (Caller buffers were waited for on the caller's streams.)
            await _cuda.wait(_cuda.record(plan.out))
            return await plan.read(here.agent, remote, *_cut(here, info.meta.agent, epoch))
        except Exception as exc:
            if plan.writes_caller:
                raise StillWriting(
                    f"nixl READ of object {info.obj_id} into the into= buffers could not be ended (its producer "
                    f"{info.meta.agent} unreachable): NIXL may still write those buffers, now or later. Give them "
                    "up (they stay registered with NIXL for this process's life) and fetch again into new "
                    "buffers, or without into="
                ) from exc
            raise
        finally:
            plan.release()

    async def _still_held(self, here: _Here, info: TransferInfo[NixlMeta], cause: BaseException) -> bool:
        """Read the liveness slot over a fresh connection: True if the object is still held.

        A READ of memory the producer has unmapped (a `free()` racing the read past the
        linger) fails its UCX endpoint for good: NIXL reports the producer disconnected,
        and the slot cannot be read over that endpoint any more. Raises ObjectFreedError
        (from `cause`) if the slot changed; any other failure here gives False, and the
        caller's error stands.
        """
        meta = info.meta
        plan = ReadPlan(info, None, here.scratch, here.memory, tensors=False)
        freed: ObjectFreedError | None = None
        held, epoch = False, None
        try:
            async with asyncio.timeout(RECHECK_S):
                remote = await here.peers.connect(meta, info.producer_node)
                epoch = here.peers.epoch(meta.agent)
                await plan.read(here.agent, remote, *_cut(here, meta.agent, epoch))
            held = True
        except ObjectFreedError as exc:
            freed = exc
        except Exception as exc:
            if _is_disconnect(exc):
                await here.peers.forget(meta.agent, epoch)
        finally:
            plan.release()
        if freed is not None:
            raise freed from cause
        return held

    def check_meta(self, info: TransferInfo[NixlMeta]) -> None:
        check(info, info.producer_pid)

    def receive_nowait(
        self, info: TransferInfo[NixlMeta], buffers: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """Read a small CPU object of a connected producer on this host, on this thread.

        Under CMA the READ completes inside `transfer()`, so this costs no hop through the
        I/O loop. Anything else (a busy agent, no free bounce chunk, a READ NIXL leaves in
        progress, an error) returns None and the fetch takes the usual path; a READ left in
        progress is finished and released on the I/O loop.
        Raises: ObjectFreedError if the liveness slot says the object is gone;
        TransferError if the metadata does not hold together (`_check`).
        """
        check(info, info.producer_pid)
        meta = info.meta
        here = self._current()
        remote = None if here is None else here.peers.remote(meta.agent)
        if (
            here is None or remote is None or meta.host != self._host
            or any(d is not None and d[3] != "DRAM" for d in meta.descs)
            or (buffers is not None and (any(b.device.type != "cpu" for b in buffers) or written_late(buffers) is not None))
            or not _alive(meta)  # the usual path says so
        ):
            return None
        agent = here.agent
        plan = ReadPlan(info, buffers, here.scratch, here.memory)
        if not plan.in_scratch or not agent.lock.acquire(blocking=False):
            plan.release()
            return None
        handed_off = False  # then the I/O loop releases the plan
        try:
            here.peers.touch(meta.agent)
            if not here.peers.load_now(meta):
                return None  # (the usual path connects anew)
            handed_off = not plan.read_now(agent, remote)
            if handed_off:
                return None
        except ObjectFreedError:
            raise
        except Exception:  # the usual path reads again and reports what is wrong
            return None
        finally:
            agent.lock.release()
            if not handed_off:
                plan.release()
        out = plan.out
        if buffers is None:
            return out
        return copy_into(buffers, out) if any(b is not o for b, o in zip(buffers, out)) else list(buffers)


@dataclasses.dataclass(frozen=True)
class _NativeErrors:
    disconnected: type[BaseException]  # the producer's agent is gone
    # The connection is unusable (gone, or a READ over it failed UCX's endpoint: a memory
    # the producer unmapped): forget it, and read over a fresh one.
    broken: tuple[type[BaseException], ...]
    every: tuple[type[BaseException], ...]  # every error class NIXL's bindings raise


@functools.cache
def _native_errors() -> _NativeErrors:
    """NIXL's error classes (each a bare Exception subclass: they share no base of their own)."""
    from nixl import _bindings

    every = tuple(
        v for k, v in vars(_bindings).items() if k.startswith("nixl") and isinstance(v, type) and issubclass(v, Exception)
    )
    gone = _bindings.nixlRemoteDisconnectError
    return _NativeErrors(gone, (gone, _bindings.nixlNotAllowedError), every)


def _cut(here: _Here, producer: str, epoch: int | None) -> tuple[Callable[[], Awaitable[None]], Callable[[], bool]]:
    """How a READ from `producer` over connection `epoch` is cut off (the connection
    dropped), and whether the producer was declared dead (`Peers.lost`: cut off at once)."""
    return functools.partial(here.peers.forget, producer, epoch), functools.partial(here.peers.doomed, producer)


def _is_disconnect(exc: BaseException) -> bool:
    """Whether `exc` says the connection is unusable (a READ over it stalled, too)."""
    return isinstance(exc, (PeerDiedError, ReadStalled, *_native_errors().broken))


def _died(info: TransferInfo[NixlMeta]) -> PeerDiedError:
    meta = info.meta
    return PeerDiedError(
        f"nixl fetch of {info.obj_id}: the producer (pid {meta.pid} on {meta.host}) died", obj_id=info.obj_id
    )


def _gone(meta: NixlMeta) -> bool | None:
    """Say whether the producer's process is gone; None for another host's (not checkable here)."""
    return None if meta.host != socket.gethostname() else not pid_alive(meta.pid)


def _alive(meta: NixlMeta) -> bool:
    """Say whether the producer may be alive (only checkable on its own host)."""
    return not _gone(meta)


def _installed(package: str) -> bool:
    """Whether `package` is installed (found, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
