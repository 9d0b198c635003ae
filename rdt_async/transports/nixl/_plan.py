"""One fetch's READs, planned once and run from the I/O loop or on the caller's thread.

A plan decides where each tensor lands (the caller's buffers, else one block per
device; the bounce buffer when the object is small and bound for CPU; a stage of the
source's kind of memory when it crosses devices on one node, see `_stage_device`), what must be
registered for the fetch, and the order of the READs: the tensors, one request per
device, then the object's liveness slot into a landing slot, then the check of its
token and the copy out of the bounce buffer. `_steps` writes that order once, without
I/O: it yields each READ and learns its outcome. `read` posts them from the I/O loop,
`read_now` on the caller's thread; a plan releases what it took when `release` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any

import torch

from ... import _alloc, _cuda, _io
from ..._local import aligned_layout, copy_into
from .._base import TransferInfo
from .._kit import local_device
from ._agent import Agent
from ._liveness import SLOT_BYTES, check_slot
from ._memory import Key, Registrations, dev_index, mem_type
from ._meta import NixlMeta
from ._scratch import BOUNCE_BYTES, Scratch
from ._xfer import Read, post, post_now

ALIGN = 64  # offsets of tensors that share a fetched block or a bounce chunk
# Fetched CPU tensors at most this large get a storage of their own (no shared block to
# keep alive, or to ship when pickled); larger ones of one object share one block.
OWN_BYTES = BOUNCE_BYTES

Desc = tuple[int, int, int, str]  # a producer's tensor: address, nbytes, device index, memory type
_log = logging.getLogger("rdt_async")
# What READs that outlived their cancel land in (ReadPlan._stuck): kept for the process's life.
_kept_for_nixl: list[Any] = []
# Of those, the bytes of callers' `into=` buffers: (device, first address, one past the last).
_written_late: list[tuple[str, int, int]] = []


def written_late(buffers: Sequence[torch.Tensor]) -> int | None:
    """Return the index of a buffer that a READ NIXL would not end may still write, or None."""
    if not _written_late:  # (every fetch into buffers asks: almost always nothing to look at)
        return None
    for i, b in enumerate(buffers):
        storage = b.untyped_storage()  # (any byte of it: conservative)
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if any(d == str(b.device) and lo < end and start < hi for d, start, end in _written_late):
            return i
    return None


class ReadPlan:
    """Where one fetch's tensors land, what it registered, and the READs in order."""

    def __init__(
        self,
        info: TransferInfo[NixlMeta],
        buffers: list[torch.Tensor] | None,
        scratch: Scratch,
        memory: Registrations,
        *,
        tensors: bool = True,
        same_host: bool = False,
    ) -> None:
        """Plan the READs of `info` (with `tensors=False`, of its liveness slot alone);
        `same_host`: the producer runs on this node."""
        self.info = info
        self._into = buffers is not None  # (its contiguous buffers are READ into directly)
        self._same_host = same_host
        self._scratch, self._memory = scratch, memory
        self.out: list[torch.Tensor] = []
        self._pairs: list[tuple[torch.Tensor, Desc]] = []  # destination bytes, remote tensor
        own: list[bool] = []  # per pair: lands apart, copied into a storage of its own
        if tensors:
            self.out, dsts = _destinations(info, buffers)
            for d, s, spec in zip(dsts, info.meta.descs, info.specs):
                if s is not None:
                    self._pairs.append((d, s))
                    own.append(buffers is None and _owns(spec))
        self._bounce = scratch.bounce.take() if tensors and _fits_bounce(self._pairs) else -1
        self._lands = self._bounce_views() if self._bounce >= 0 else _lands_apart(self._pairs, own)
        # Reads that cross devices on one node: (pair index, where their stage goes), made by `read`.
        self._to_stage = [
            (k, where) for k, (d, s) in enumerate(self._pairs)
            if self._bounce < 0 and (where := _stage_device(d, s, same_host)) is not None
        ]
        self._landing = scratch.landing.take()
        self._lslot = (
            scratch.landing.view(self._landing) if self._landing >= 0
            else torch.zeros(2, dtype=torch.int64)  # registered for this fetch only
        )
        self._keys: list[Key] = []
        self._held_by_nixl = False
        # A READ NIXL would not end lands in the caller's own buffers (`into=`): they may change yet.
        self.writes_caller = False

    @property
    def in_scratch(self) -> bool:
        """Say whether every READ lands in memory registered once (what `read_now` needs)."""
        return self._bounce >= 0 and self._landing >= 0

    async def read(
        self, agent: Agent, remote: str, disconnect: Callable[[], Awaitable[None]], gone: Callable[[], bool]
    ) -> list[torch.Tensor]:
        """Register what the READs need, post them in order, and return the tensors.

        `disconnect` closes the connection to `remote`: a cancelled READ that NIXL cannot
        let go of otherwise (its reply held up by a partition) ends so, at once where
        `gone()` (the producer was declared dead), else after a grace.
        Runs on: consumer (I/O loop).
        Raises: ObjectFreedError if the liveness slot says the object is gone, else the
        first failed READ's error.
        """
        staged = await self._make_stages() if self._to_stage else []
        to_register = (self._lands if self._bounce < 0 else []) + ([self._lslot] if self._landing < 0 else [])
        self._keys = await self._memory.register_all(to_register)
        steps = self._steps()
        failed: Exception | None = None  # the last READ's error, thrown into the steps
        try:
            while True:
                read = steps.send(None) if failed is None else steps.throw(failed)
                try:
                    await post(agent, remote, read, disconnect, self._stuck, gone)
                    failed = None
                except Exception as exc:
                    failed = exc
        except StopIteration:
            pass
        finally:
            steps.close()
        if staged:  # a device copy (ms at these sizes): in the pool, finished on return
            await _io.to_thread_finished(_cuda.settled, copy_into, [d for d, _ in staged], [st for _, st in staged])
        return self.out

    async def _make_stages(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocate the stages (in the pool: pinned memory's first allocation takes ms) and
        land those READs in them; return (destination, stage) pairs."""
        stages = await _io.to_thread(_new_stages, [(self._pairs[k][0].numel(), where) for k, where in self._to_stage])
        # Memory just allocated may still be in use by work queued on its device's streams.
        await _cuda.wait(_cuda.record([st for st in stages if st.is_cuda]))
        for (k, _), st in zip(self._to_stage, stages):
            self._lands[k] = st
        return [(self._pairs[k][0], st) for (k, _), st in zip(self._to_stage, stages)]

    def read_now(self, agent: Agent, remote: str) -> bool:
        """Post the READs on this thread, the agent held (by the caller). Needs `in_scratch`.

        Returns False once a READ is left in progress: the I/O loop finishes it and then
        releases this plan. Raises: ObjectFreedError, the first failed READ's error.
        """
        steps = self._steps()
        try:
            for read in steps:
                if not post_now(agent, remote, read, self.release, self._stuck):
                    return False
        finally:
            steps.close()
        return True

    def _stuck(self) -> None:
        """A READ of this plan outlived its cancel or its stall (its connection closed) or its hand-off:
        NIXL may still write its memory, so `release` gives none of it back (a leak, never a late write
        into memory used again)."""
        self._held_by_nixl = True
        self.writes_caller = self._into and any(land is d for (d, _), land in zip(self._pairs, self._lands))
        _written_late.extend(
            (str(d.device), d.data_ptr(), d.data_ptr() + d.numel()) for (d, _), land in zip(self._pairs, self._lands) if land is d
        )
        _kept_for_nixl.append((self._lands, self.out, self._lslot))  # their storages outlive every reference
        _log.warning(
            "rdt_async: a nixl READ of object %s, cancelled or stalled, could not be ended (its producer unreachable): "
            "the memory it lands in stays registered and is never reused%s", self.info.obj_id,
            " by rdt_async; it lands in the fetch's into= buffers, which NIXL may still write: give them up"
            if self.writes_caller else "",
        )

    def release(self) -> None:
        """Give back the landing slot, the bounce chunk and the fetch's registrations (once),
        unless a READ NIXL still holds lands in them."""
        if self._held_by_nixl:
            return
        self._scratch.landing.give(self._landing)
        self._scratch.bounce.give(self._bounce)
        self._landing = self._bounce = -1
        if self._keys:
            keys, self._keys = self._keys, []
            self._memory.release(keys)

    def _steps(self) -> Generator[Read, None, None]:
        """Yield the READs in order; the driver throws a failed READ's error in.

        A READ of the tensors that fails (a read of freed memory can) stops the others,
        and the slot is read all the same: a changed token makes the fetch's error
        ObjectFreedError.
        """
        error: Exception | None = None
        for read in self._tensor_reads():
            try:
                yield read
            except Exception as exc:
                error = exc
                break
        self._lslot.zero_()
        try:
            yield Read([(self._lslot.data_ptr(), SLOT_BYTES, 0)], [(self.info.meta.slot, SLOT_BYTES, 0)])
        except Exception:
            self._discard()
            if error is not None:
                raise error from None
            raise
        try:
            check_slot(self._lslot, self.info, error)
        except BaseException:
            self._discard()
            raise
        if error is not None:
            self._discard()
            raise error
        apart = [(d, land) for (d, _), land in zip(self._pairs, self._lands) if land is not d and land.device == d.device]
        # (stages, on another device, are copied out by `read`, off the I/O loop)
        if apart:
            copy_into([d for d, _ in apart], [land for _, land in apart])

    def _discard(self) -> None:
        """Zero what the READs wrote where the caller sees it (its `into=` buffers, the
        tensors it would get): a failed fetch hands over no byte it read."""
        for (d, _), land in zip(self._pairs, self._lands):
            if land is d:
                d.zero_()

    def _tensor_reads(self) -> list[Read]:
        """The tensors' READs: one per local device and remote memory (and device)."""
        pairs = self._pairs
        if self._bounce >= 0 and all(s[3] == "DRAM" for _, s in pairs):
            # The usual small read, CPU into one CPU chunk: one request, no device to ask torch about.
            local = [(d.data_ptr(), d.numel(), 0) for d in self._lands]
            return [Read(local, [s[:3] for _, s in pairs])] if pairs else []
        groups: dict[tuple[torch.device, str, int], list[tuple[torch.Tensor, Desc]]] = {}
        for d, (_, s) in zip(self._lands, pairs):
            groups.setdefault((d.device, s[3], s[2]), []).append((d, s))
        reads = []
        for (_, remote_mem, _), group in groups.items():
            local_mem, index = mem_type(group[0][0]), dev_index(group[0][0])
            on_device = self._same_host and local_mem == remote_mem == "VRAM"
            reads.append(
                Read([(d.data_ptr(), d.numel(), index) for d, _ in group], [s[:3] for _, s in group], local_mem, remote_mem, on_device)
            )
        return reads

    def _bounce_views(self) -> list[torch.Tensor]:
        chunk, off, out = self._scratch.bounce.view(self._bounce), 0, []
        for _, s in self._pairs:
            out.append(chunk[off : off + s[1]])
            off += -(-s[1] // ALIGN) * ALIGN
        return out


def _owns(spec: Any) -> bool:
    """Say whether a fetched tensor of `spec` gets a storage of its own (small, CPU)."""
    return 0 < spec.nbytes <= OWN_BYTES and local_device(spec.device).type == "cpu"


# Reads that cross devices on one node land in a stage of the source's kind from this size.
STAGE_BYTES = 1 << 20


def _stage_device(d: torch.Tensor, s: Desc, same_host: bool) -> torch.device | None:
    """Where a READ of `s` into `d` lands first when it crosses devices on one node
    (pinned host memory: the CPU; or a GPU of this process), else None.

    UCX moves memory between two processes of a node with CUDA IPC (device to device)
    or CMA (host to host); a READ from one kind into the other has neither and goes
    over TCP through host staging (0.4-0.8 GB/s on an H200, where a pinned cudaMemcpy
    moves 54). So it is read into memory of the source's kind here, and copied into `d`
    by the device after.
    """
    if not same_host or d.numel() < STAGE_BYTES:
        return None
    if s[3] == "DRAM" and d.device.type == "cuda":  # (a CUDA destination: CUDA is here)
        return torch.device("cpu")
    if s[3] == "VRAM" and d.device.type == "cpu" and torch.cuda.is_available():  # asked last: it calls into CUDA
        return local_device(f"cuda:{s[2]}")
    return None


def _new_stages(wanted: list[tuple[int, torch.device]]) -> list[torch.Tensor]:
    """Allocate stages of (bytes, device): host ones pinned (torch's pinned cache: warm after the first)."""
    return [
        torch.empty(n, dtype=torch.uint8, pin_memory=True) if where.type == "cpu"
        else torch.empty(n, dtype=torch.uint8, device=where)
        for n, where in wanted
    ]


def _lands_apart(pairs: list[tuple[torch.Tensor, Desc]], own: list[bool]) -> list[torch.Tensor]:
    """Where each READ lands without a bounce chunk: the destination itself, but for
    tensors of their own, one block for them all (one registration, copied out after)."""
    sizes = [d.numel() for (d, _), o in zip(pairs, own) if o]
    if not sizes:
        return [d for d, _ in pairs]
    offsets, total = aligned_layout(sizes, ALIGN)
    block = _alloc.empty((total,), torch.uint8)
    at = iter(offsets)
    out = []
    for (d, _), o in zip(pairs, own):
        if o:
            i = next(at)
            out.append(block[i : i + d.numel()])
        else:
            out.append(d)
    return out


def _fits_bounce(pairs: list[tuple[torch.Tensor, Desc]]) -> bool:
    """Say whether a read this small lands in CPU memory (then it goes through a bounce chunk)."""
    return sum(-(-s[1] // ALIGN) * ALIGN for _, s in pairs) <= BOUNCE_BYTES and all(
        d.device.type == "cpu" for d, _ in pairs
    )


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
    """Allocate one byte block per device and return each spec's tensor as a view of it
    (small CPU tensors: a tensor of its own, see `_owns`).

    Each view's storage is the whole block (one registration per fetch): the gaps that
    align its tensors are zeroed, so the block holds this object's bytes and zeros only,
    never an earlier receive's (a reused block's), which `untyped_storage()`, `torch.save`
    or a pickle of one of the tensors would carry along.
    """
    offsets: list[tuple[torch.device, int]] = []
    sizes: dict[torch.device, int] = {}
    for spec in specs:
        device = local_device(spec.device)
        if _owns(spec):
            offsets.append((device, -1))
            continue
        offsets.append((device, sizes.get(device, 0)))
        sizes[device] = sizes.get(device, 0) + -(-spec.nbytes // ALIGN) * ALIGN
    blocks = {d: _alloc.empty((n,), torch.uint8, d) for d, n in sizes.items()}  # CPU: reused, warm
    out = []
    for spec, (device, off) in zip(specs, offsets):
        if spec.nbytes == 0 or off < 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
            continue
        block, end = blocks[device], off + spec.nbytes
        gap = -spec.nbytes % ALIGN
        if gap:
            block[end : end + gap].zero_()
        out.append(block[off:end].view(spec.dtype).view(spec.shape))
    return out
