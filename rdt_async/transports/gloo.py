"""`gloo`: two-sided, receiver-driven transfers over standalone Gloo process groups.

Groups are standalone `ProcessGroupGloo`s (no global default group), so a process may
be in any number of groups at once: `join` makes a member's process group (NCCL's too)
over a rendezvous store whose keys live in a key-value service the caller hands in
(`_kvstore`: Ray's GCS for collective groups; no port is opened for it), and records
it in the membership registry (`rdt_async._membership.groups`, also `groups` here).
Gloo's own listener binds the member's node address (or GLOO_SOCKET_IFNAME's interface)
on a port the kernel picks. A transfer:

    consumer                                    producer (its `rdt` group)
    --------                                    --------
    post recvs: status, the pack, one per other tensor (a block of unique tags)
    request_send({group, dst, tag, specs})   -> post sends: status HELD, pack, tensors; wait (pool)
    wait recvs (pool): done                  <- reply (not waited for once the status says HELD)
Small tensors travel packed into one message (`_packing`, worked out from the specs on
both ends): a state dict of thousands of them was thousands of messages, ~50 us each.
Gloo's point-to-point `Work` has no future, so each wait runs in a bounded pool of
waiter threads and completion reaches the caller's loop through the I/O loop. The
status message makes the data self-describing, so a fetch ends when its bytes land,
not one Ray reply later. A producer that no longer holds the object sends status
FREED and zeros of the right size (so the consumer's posted receives complete), and
its reply raises ObjectFreedError. Gloo cannot cancel a posted receive: a cancelled
fetch whose receives land in the caller's `into=` buffers returns once they have landed
(at most `DRAIN_S`, or the group's own timeout where longer: a Gloo receive ends by then,
aborted or not; then the group is aborted), and one landing in buffers of its own
returns at once.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import numpy
import torch
import torch.distributed as dist

from .. import _cuda, _io
from .._errors import CollectiveGroupError, ObjectFreedError, PeerDiedError, RDTError, TransferError, few
from .._local import aligned_layout
from .._membership import TAG_LIMIT as TAG_LIMIT
from .._membership import Group as Group
from .._membership import check_timeout
from .._membership import groups as groups
from ._base import Channel, Cost, TransferInfo, Transport, check_specs
from ._kit import delivered, landing_buffers, lands_in
from ._kvstore import KV, KVStore, StoreClosedError

HELD, FREED, MISMATCH = 1, 2, 3  # the status message that comes before an object's tensors
PACK_BYTES = 64 << 10  # tensors under this many bytes travel packed into one message ...
PACK_MAX_BYTES = 64 << 20  # ... up to this many in all (its copies on both ends stay small)
PACK_ALIGN = 64
REPLY_AFTER_FAILURE_S = 10.0  # how long a failed receive waits for Ray's word on the producer
DRAIN_S = 30.0  # how long a cancelled fetch waits for receives that write caller buffers
GIVEN_UP_JOINS = 4  # joins given up but still connecting that run on at once (half a member's group threads)

# Joins under way: (group name, attempt) -> its rendezvous store, which `leave` closes;
# and attempts left before their join began here, which that join then refuses (so that
# nothing writes a key after the caller deleted them). Keyed by attempt too: a join given
# up but still connecting (to a member that died after saying where it listens: Gloo's
# connect retries run to about 5x timeout_s, and closing the store cannot end them) never
# holds up the next creation of the name. Such a join runs on in a thread of the member's
# group calls: while GIVEN_UP_JOINS of them do, a join is refused (not left to take the rest).
_joining: dict[tuple[str, str], KVStore] = {}
_abandoned: collections.deque[str] = collections.deque(maxlen=1024)
_joining_lock = threading.Lock()


def join(
    name: str,
    backend: str,
    rank: int,
    size: int,
    *,
    kv: KV,
    host: str,
    attempt: str,
    members: Sequence[str] = (),
    timeout_s: float,
) -> None:
    """Make this process's process group of a collective group and record it in `groups`.

    The members meet through `kv` (this `attempt`'s keys, scoped by the caller; no port
    is opened for it); Gloo's listener binds `host` (this process's node address) or the
    interface GLOO_SOCKET_IFNAME names. `members`: who holds each rank (checked against a
    ref's producer). Blocks until every member joined: call it off the loop. A join whose
    attempt is left meanwhile (`leave`) ends at once while it waits for the others'
    keys; one already connecting to them ends when Gloo's connect does (about 5x
    `timeout_s` where a member died meanwhile), and its process group is then dropped,
    never recorded; a new attempt under the name need not wait for it. While
    GIVEN_UP_JOINS such joins run on in this process, it joins no group.
    Raises: CollectiveGroupError (already in a group of that name, a bad backend or
    timeout, no GPU, the attempt was left meanwhile, too many given-up joins run on, or
    Gloo's connect timed out: it names this member's address and the ports to open);
    the backend's error if the rendezvous fails.
    """
    if groups.get(name) is not None:
        raise CollectiveGroupError(f"this process is already in a group named {name!r}")
    if backend not in ("gloo", "nccl"):
        raise CollectiveGroupError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    check_timeout(timeout_s)
    if type(rank) is not int or type(size) is not int or not 0 <= rank < size:
        raise CollectiveGroupError(f"group {name!r}: rank {rank!r} of {size!r} is no rank of a group (0 <= rank < size)")
    if members and (len(members) != size or not all(isinstance(m, str) for m in members)):
        raise CollectiveGroupError(
            f"group {name!r}: {len(members)} members named for {size} ranks ({few([str(m)[:8] for m in members])}); "
            "the creator names one actor id per rank"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise CollectiveGroupError("backend 'nccl' needs a CUDA GPU in every member; use backend='gloo'")
    store = KVStore(kv, timeout_s, f"rendezvous of group {name!r} (rank {rank} of {size})")
    key = (name, attempt)
    with _joining_lock:
        if attempt in _abandoned:
            _abandoned.remove(attempt)
            raise CollectiveGroupError(f"the creation of group {name!r} was given up before this member joined")
        if key in _joining:
            raise CollectiveGroupError(f"this process is already joining this creation of group {name!r}")
        running_on = sum(s.closed for s in _joining.values())
        if running_on >= GIVEN_UP_JOINS:
            raise CollectiveGroupError(
                f"this member cannot join group {name!r} now: {running_on} joins of creations that were given up "
                "still connect to members that died (Gloo ends each within about 5x its timeout_s, and each holds "
                "one of this member's threads); create the group again once they have ended"
            )
        _joining[key] = store
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, untyped
            opts._timeout = timedelta(seconds=timeout_s)
            opts._devices = [_listener_device(host)]
            pg: Any = dist.ProcessGroupGloo(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)  # reads the store again per communicator
    except Exception as exc:
        with _joining_lock:
            _joining.pop(key, None)
        if store_closed(exc):
            raise CollectiveGroupError(f"group {name!r} was torn down while this member joined it") from exc
        if backend == "gloo" and "Connect timeout" in str(exc):
            iface = os.environ.get("GLOO_SOCKET_IFNAME")
            raise CollectiveGroupError(
                f"group {name!r}: rank {rank} of {size}, listening on {host}{f' ({iface})' if iface else ''}, could "
                f"not connect with the other members ({exc}): a firewall between their hosts may drop Gloo's "
                "connections. Each member listens on a port the kernel picks (no setting confines it): open the "
                "ephemeral range (net.ipv4.ip_local_port_range) between the members' hosts"
            ) from exc
        raise
    group = Group(name, backend, rank, size, pg, store, members=tuple(members), creation=attempt, timeout_s=timeout_s)
    given_up: BaseException | None = None
    with _joining_lock:  # `leave` decides under this lock too: the group is recorded, or this attempt was left
        _joining.pop(key, None)
        if store.closed:
            given_up = CollectiveGroupError(f"the creation of group {name!r} was given up while this member joined it")
        else:
            try:
                groups.add(group)  # (another attempt's join of the name may have ended first)
            except CollectiveGroupError as exc:
                given_up = exc
    if given_up is not None:
        store.close()
        try:
            pg.abort()  # its peers' work with it ends now, not at their timeout
        except Exception:
            pass
        raise given_up


def leave(name: str, attempt: str | None = None) -> bool:
    """Leave group `name`, ending a join of it under way; False if this process was not in it.

    `attempt`: leave only that creation (its join under way ends; where it has not begun
    here yet, it is refused when it comes); a group made anew under the name stays.
    None: whichever creation this process is in or joining.
    """
    with _joining_lock:
        if attempt is None:
            stores = [s for (n, _), s in _joining.items() if n == name]
        else:
            joining = _joining.get((name, attempt))
            stores = [joining] if joining is not None else []
            group = groups.get(name)
            if joining is None and (group is None or group.creation != attempt):
                _abandoned.append(attempt)
    for s in stores:
        s.close()  # returns once no write of it is under way
    return groups.leave(name, attempt)


def store_closed(exc: BaseException) -> bool:
    """Whether `exc`, from making a process group, says its rendezvous store was closed."""
    return isinstance(exc, StoreClosedError) or "StoreClosedError" in str(exc)


def _listener_device(host: str) -> Any:
    """Gloo's listener: on GLOO_SOCKET_IFNAME's interface where set, else on `host` only.

    Gloo binds this address with port 0 (the kernel picks the port: Gloo has no setting
    for it) and tells the other members that address through the store.
    """
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if iface:
        return dist.ProcessGroupGloo.create_device(interface=iface)
    return dist.ProcessGroupGloo.create_device(hostname=host)


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
    needs_group = True  # a group of backend `name` both ends are in
    can_abort = False
    auto_costs: ClassVar[Mapping[str, Cost]] = {"cpu/node": Cost(0.0055, 1.33), "cpu/hosts": Cost(0.0062, 1.03)}

    @classmethod
    def group_meta(cls, group: str, rank: int) -> GlooMeta:
        return GlooMeta(group, rank)

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        return PeerDiedError if lost_peer(exc) else None

    async def receive(
        self, info: TransferInfo[GlooMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        group, src = checked_source(info, _device(self))  # before anything is posted
        packed, offsets, size = _packing([(tuple(s.shape), s.dtype) for s in info.specs])
        given: list[torch.Tensor | None] = list(buffers) if buffers is not None else [None] * len(info.specs)
        pack = None
        if packed:
            pack = torch.empty(size, dtype=torch.uint8, device=_device(self))
            kind = torch.device(_device(self)).type
            for i, off in zip(packed, offsets):  # where the caller's buffer cannot take it: a view of the pack
                if not lands_in(given[i], kind):
                    given[i] = _in_pack(pack, off, info.specs[i].shape, info.specs[i].dtype)
        dsts = landing_buffers(info.specs, given, _device(self))
        base = group.tags(len(dsts) + 2)
        status = torch.zeros(1, dtype=torch.int64, device=_device(self))
        request: dict[str, Any] = {
            "group": group.name,
            "creation": group.creation,
            "dst": group.rank,
            "tag": base,
            "specs": [(tuple(s.shape), s.dtype) for s in info.specs],
        }
        reply: asyncio.Future[Any] | None = None
        waiting: asyncio.Future[None] | None = None
        clean = False  # a failure that left the pair as it was (every posted receive completed)
        try:
            # Posting raises at once where the pair is already closed (a dead producer).
            works = [group.pg.recv([status], src, base)]
            if pack is not None:
                works.append(group.pg.recv([pack], src, base + 1))
            alone = _alone(dsts, packed)
            works += [group.pg.recv([_bytes(dsts[i])], src, base + 2 + i) for i in alone]  # (see _send)
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
            state = int(status.item())
            if state != HELD:
                said = await reply  # FREED: raises ObjectFreedError
                if state == MISMATCH:
                    clean = True
                    raise TransferError(
                        f"{self.name} fetch of {info.obj_id}: its ref describes tensors "
                        f"{_says(request['specs'])}, but its producer holds {said}: the ref was altered, or "
                        "is not this object's; nothing was received (the group is unharmed)",
                        obj_id=info.obj_id,
                    )
                raise ObjectFreedError(f"object {info.obj_id} was freed before it was fetched", obj_id=info.obj_id)
        except asyncio.CancelledError:
            if waiting is not None and self._writes_theirs(buffers, dsts):
                # They write the caller's memory (not after we return), or (NCCL) the pair's
                # next transfer would meet these receives: they complete first.
                await _drain(group, waiting)
            raise
        except BaseException as exc:
            if isinstance(exc, ObjectFreedError) and waiting is not None and self._writes_theirs(buffers, dsts):
                # The producer's word (freed) can come before the zeros it sends to complete
                # these receives: they land before the caller has its buffers back.
                await _drain(group, waiting)
            if not clean and not isinstance(exc, (asyncio.CancelledError, ObjectFreedError)):
                groups.mark_broken(group, f"a transfer failed: {type(exc).__name__}")
            raise
        finally:
            if reply is not None:  # the bytes are here (or the fetch ended): its reply is news to nobody
                reply.add_done_callback(_consume)  # runs soon if it is done already
        if pack is not None and buffers is not None:  # the caller's buffers of packed tensors: copied out
            mine = [(dsts[i], off) for i, off in zip(packed, offsets) if dsts[i] is buffers[i]]
            if mine:
                torch._foreach_copy_([_bytes(d) for d, _ in mine], [pack[off : off + d.nbytes] for d, off in mine])
        out = delivered(buffers, dsts)
        await _cuda.wait(_cuda.record(out))  # NCCL: copies into strided buffers ran on this thread's stream
        return out

    def _writes_theirs(self, buffers: list[torch.Tensor] | None, dsts: list[torch.Tensor]) -> bool:
        """Whether posted receives must end before a failed receive returns: they write the
        caller's buffers, or (NCCL) the pair's next transfer would meet them."""
        return self.matches_in_order or (buffers is not None and any(d is b for d, b in zip(dsts, buffers)))

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: Any, request: dict[str, Any]
    ) -> str | None:
        """Send the object's tensors; where the consumer's ref described other tensors, send
        status MISMATCH and zeros of what it described instead, and answer what is held."""
        group, dst, base, specs = checked_request(request)
        held = [(tuple(t.shape), t.dtype) for t in tensors]
        if specs != held:
            await self._send(group, dst, base, _zeros(specs, _device(self)), MISMATCH)
            return _says(held)
        await self._send(group, dst, base, tensors, HELD)
        return None

    async def _send(self, group: Group, dst: int, base: int, tensors: Sequence[torch.Tensor], state: int) -> None:
        srcs = [t.contiguous() for t in tensors]
        packed, offsets, size = _packing([(tuple(t.shape), t.dtype) for t in srcs])
        works = [group.pg.send([torch.full((1,), state, dtype=torch.int64, device=_device(self))], dst, base)]
        if packed:
            pack = torch.zeros(size, dtype=torch.uint8, device=_device(self))  # (its gaps: zeros, not stale bytes)
            sources = [_bytes(srcs[i]) for i in packed]
            torch._foreach_copy_([pack[off : off + b.numel()] for off, b in zip(offsets, sources)], sources)
            works.append(group.pg.send([pack], dst, base + 1))
        # As bytes: NCCL's point-to-point carries only the dtypes it reduces (no int16,
        # uint16/32/64, complex...), and refused the others inside the transfer.
        works += [group.pg.send([_bytes(srcs[i])], dst, base + 2 + i) for i in _alone(srcs, packed)]
        await self.wait_works(works)

    async def wait_works(self, works: Sequence[Any]) -> None:
        """Wait for point-to-point works (Gloo: waiter threads, as `Work` has no future)."""
        await wait_works(works)

    async def refuse(self, obj_id: str, request: dict[str, Any]) -> None:
        """The object is gone: status FREED, and zeros to complete the consumer's receives."""
        group, dst, base, specs = checked_request(request)
        await self._send(group, dst, base, _zeros(specs, _device(self)), FREED)


def checked_source(info: TransferInfo[GlooMeta], device: str) -> tuple[Group, int]:
    """Check what a ref says of its group and producer, before anything is posted.

    The ref came from another process: its group must be one this process is in (and
    usable), its producer a member of it other than us (the rank is where the group's
    members put the producer's actor now, not the one the ref names: a group made anew
    under its name may have put it elsewhere; where members or producer are unknown, the
    ref's rank, in range), and its tensors described sanely. A receive posted from the
    wrong rank, or of the wrong size, could only end by breaking the group.
    Runs on: consumer (microseconds).
    Raises: CollectiveGroupError (not in the group, or it is broken); TransferError.
    """
    meta = info.meta
    what = f"fetch of {info.obj_id} over group {meta.group!r}"
    if not isinstance(meta.group, str):
        raise TransferError(f"fetch of {info.obj_id}: its ref names no group ({meta.group!r})", obj_id=info.obj_id)
    group = groups.require(meta.group)
    src = meta.src
    made_by = getattr(info.hold, "producer", None)  # the RDTObject's, where there is one (a transport driven alone: none)
    known = bool(group.members) and made_by is not None
    if type(src) is not int or src < 0 or (src >= group.size and not known):
        raise TransferError(
            f"{what}: its ref says the producer is rank {src!r}, not a rank of this group of {group.size} "
            "(the ref was altered); nothing was received",
            obj_id=info.obj_id,
        )
    if known:
        # The producer's rank is where its actor is now: an object made before the group
        # was made anew under its name (in another rank order) names the rank it had then.
        producer = getattr(made_by, "actor_id", None)  # (no actor id: no member's)
        if producer not in group.members:
            raise TransferError(
                f"{what}: its producer ({getattr(made_by, 'label', str(producer)[:8])}) holds no rank of this "
                "group (the group was made anew without it since the object was made, or the ref was altered); "
                "nothing was received",
                obj_id=info.obj_id,
            )
        src = group.members.index(producer)
    if src == group.rank:
        raise TransferError(
            f"{what}: its ref says the producer is rank {src}, this process's own rank (the ref was altered); "
            "nothing was received",
            obj_id=info.obj_id,
        )
    check_specs(info.specs, info.obj_id)  # (the core checked them too; a transport driven alone did not)
    for spec in info.specs:
        if str(spec.device).split(":")[0] != device:
            raise TransferError(
                f"{what}: its ref describes a tensor as {spec.dtype!r}{list(spec.shape)}@{spec.device} (the ref was altered); "
                "nothing was received",
                obj_id=info.obj_id,
            )
    return group, src


def checked_request(request: Any) -> tuple[Group, int, int, list[tuple[tuple[int, ...], torch.dtype]]]:
    """Check a consumer's request before anything is sent; return (group, dst, first tag, specs).

    Runs on: producer.
    Raises: CollectiveGroupError (not in the group, or it is broken); TransferError for a
    request no consumer of ours makes (nothing is sent then).
    """
    if not isinstance(request, dict) or not isinstance(request.get("group"), str):
        raise TransferError(f"a gloo send was asked without a group: {str(request)[:100]!r}")
    group = groups.require(request["group"])
    if request.get("creation") != group.creation:
        raise CollectiveGroupError(
            f"a send over group {group.name!r} was asked for another creation of it (a request left by a "
            "fetch that ended before the group was made anew under its name): nothing was sent"
        )
    dst: Any = request.get("dst")
    base: Any = request.get("tag")
    specs: Any = request.get("specs")
    ok = (
        type(dst) is int
        and 0 <= dst < group.size
        and dst != group.rank
        and isinstance(specs, list)
        and all(_is_spec(s) for s in specs)
        and type(base) is int
        and 1 <= base
        and base + 2 + len(specs) <= TAG_LIMIT
    )
    if not ok:
        raise TransferError(
            f"a gloo send over group {group.name!r} (rank {group.rank} of {group.size}) was asked for "
            f"rank {dst!r}, tag {base!r}, {len(specs) if isinstance(specs, list) else specs!r} tensors: "
            "not a request this transport makes; nothing was sent"
        )
    return group, dst, base, [(tuple(shape), dtype) for shape, dtype in specs]


def _is_spec(spec: Any) -> bool:
    return (
        isinstance(spec, tuple)
        and len(spec) == 2
        and isinstance(spec[1], torch.dtype)
        and isinstance(spec[0], tuple)
        and all(type(d) is int and d >= 0 for d in spec[0])
    )


def _packing(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], list[int], int]:
    """Which tensors travel packed into one message (their places, in order), each one's
    offset in the pack, and its bytes: those under PACK_BYTES, up to PACK_MAX_BYTES in all,
    where two or more are. Both ends work it out from the same specs."""
    places, sizes, total = [], [], 0
    for i, (shape, dtype) in enumerate(specs):
        n = math.prod(shape) * dtype.itemsize
        if 0 < n < PACK_BYTES and total + n <= PACK_MAX_BYTES:
            places.append(i)
            sizes.append(n)
            total += -(-n // PACK_ALIGN) * PACK_ALIGN
    if len(places) < 2:
        return [], [], 0  # one alone is one message anyway
    offsets, size = aligned_layout(sizes, PACK_ALIGN)
    return places, offsets, size


def _alone(tensors: Sequence[torch.Tensor], packed: Sequence[int]) -> list[int]:
    """The places of the tensors that travel in messages of their own (not packed, not empty)."""
    inside = set(packed)
    return [i for i, t in enumerate(tensors) if t.numel() and i not in inside]


def _in_pack(pack: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = math.prod(shape) * dtype.itemsize
    return pack[offset : offset + n].view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _zeros(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: str) -> list[torch.Tensor]:
    """Zeros of each spec, as views of one buffer (the largest): only sent, never written.

    The specs are a consumer's (a ref's, maybe crafted): on the CPU the buffer is calloc's
    (NumPy's zeros), whose pages the kernel maps to its one zero page as they are read, so
    a ref claiming GiBs costs the producer no memory (torch.zeros wrote every page).
    """
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    if device == "cpu":
        block = torch.from_numpy(numpy.zeros(max(sizes, default=0), dtype=numpy.uint8))
    else:
        block = torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=device)
    return [
        block[:size].view(dtype).view(shape) for (shape, dtype), size in zip(specs, sizes)
    ]


def _says(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """Specs as a reader would write them: float32[4, 2], int64[3] (the first few)."""
    return "[" + few([f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, dtype in specs]) + "]"


async def _drain(group: Group, waiting: asyncio.Future[None]) -> None:
    """Wait (bounded) for a cancelled fetch's receives; abort the group if they hang.

    Bounded by DRAIN_S, or by the group's own timeout where it is longer: aborting a Gloo
    group does not end a receive posted in it (a send arriving after the abort still
    landed), its timeout does; the caller's buffers are handed back only after that.
    """
    bound = max(DRAIN_S, group.timeout_s + 1.0)
    done, _ = await asyncio.wait({waiting}, timeout=bound)
    if done:
        _consume(waiting)
    else:
        groups.abort(group, f"a cancelled fetch's receives did not complete in {bound:.0f} s")


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
    auto_costs: ClassVar[Mapping[str, Cost]] = {"gpu/node": Cost(0.004, 40.0), "gpu/hosts": Cost(0.006, 8.0)}  # not measured (one GPU)
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
        checked_source(info, "cuda")  # (a key of _pairs, too)
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
