"""The consumer's check of an object's NIXL metadata, before any of it reaches NIXL.

Everything a `NixlMeta` holds came from another process. NIXL itself bounds a READ only
by the metadata the consumer loaded (`createXferReq` refuses descriptor lists of
different counts or lengths, and remote regions that no loaded registration covers);
the producer's side bounds nothing (UCX reads over CMA with `process_vm_readv`, and its
TCP emulation of a GET copies from whatever address it is sent). So before a blob is
loaded or a READ posted, the consumer checks that the metadata hangs together:

- every field has its type; the agent's name is the one the producer makes
  (`rdt-<host>-<pid>-<hex>`) for the ref's host and pid, and the pid is the ref's
  producer's;
- every metadata blob is NIXL's serialized form and names that agent (a blob naming
  another agent would add regions to that agent's entry here);
- the blobs agree: a region two of them (or one, twice) declare comes with the same
  backend metadata each time (NIXL refuses a region it holds that comes again with
  other metadata, and then cannot reach the producer again: `_peers`);
- one descriptor per tensor, none for an empty one; each is as long as its tensor
  (`TensorSpec.nbytes`), of the spec's memory kind and device, and inside a region the
  object's blobs declare; the liveness slot is 16 bytes inside a declared DRAM region.

A failure is a TransferError naming the field; nothing was loaded, registered or read.
What these checks cannot see (a descriptor moved within a region the producer did
register: the blobs are the ref's own) the liveness slot's digest catches after the
READ (`_liveness`).
Blobs are parsed once each (their parses remembered up to PARSED_BYTES, blobs and
parsed regions together, as a ref may carry blobs of any size); a check costs
microseconds per tensor.
"""

from __future__ import annotations

import bisect
import collections
import functools
import re
import struct
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from ..._errors import TransferError
from .._base import TensorSpec, TransferInfo
from ._liveness import SLOT_BYTES
from ._meta import NixlMeta

_U64 = struct.Struct("<Q")
_DESC = struct.Struct("<QQQ")  # nixlBasicDesc: address, length, device id
_MEM = {0: "DRAM", 1: "VRAM"}  # nixl_mem_t values this transport registers
_NAME = re.compile(r"rdt-(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{8}")
_MAX_ADDR = 1 << 64
# Bytes of parsed metadata remembered, by each of the parse and the index of regions:
# the blobs and what was parsed out of them (blobs come from other processes' refs, of
# any size). An object of 16,000 storages has ~2 MB of blobs, ~5 MB parsed.
PARSED_BYTES = 32 << 20
# What each region holds beyond its bytes in the blob: parsed (a Region, its ints, its
# backend metadata's bytes object: ~160-200 measured), and in an index (two ints: ~55).
REGION_BYTES = 200
SPAN_BYTES = 64

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Remembered(Generic[K, V]):
    """`fn`'s results by argument, the least recently used forgotten past `limit` bytes of
    arguments and results (`size(arg, result)`); one over a quarter of that is not remembered."""

    def __init__(self, fn: Callable[[K], V], size: Callable[[K, V], int], limit: int) -> None:
        self._fn, self._size, self._limit = fn, size, limit
        self._done: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()  # (checks run on callers' threads and the I/O loop)

    def __call__(self, arg: K) -> V:
        with self._lock:
            hit = self._done.get(arg)
            if hit is not None:
                self._done.move_to_end(arg)
                return hit[0]
        value = self._fn(arg)
        n = self._size(arg, value)
        with self._lock:
            if n <= self._limit // 4 and arg not in self._done:
                self._done[arg] = (value, n)
                self.nbytes += n
                while self.nbytes > self._limit:
                    self.nbytes -= self._done.popitem(last=False)[1][1]
        return value


class Region(NamedTuple):
    """A registered region a metadata blob declares."""

    mem: str
    addr: int
    nbytes: int
    dev: int


class Blob(NamedTuple):
    """What a NIXL metadata blob says: whose it is, the regions it declares, and the
    backend's metadata of each (what reaches it: over UCX, its remote key)."""

    agent: str
    regions: tuple[Region, ...]
    backend: tuple[bytes, ...]


class _Reader:
    """NIXL's serialization (`nixlSerDes`): fields of tag, 8-byte length, bytes, '|'."""

    def __init__(self, data: bytes) -> None:
        if not data.startswith(b"nixlSerDes|"):
            raise ValueError("not NIXL metadata (no nixlSerDes header)")
        self._data, self._at = data, len(b"nixlSerDes|")

    def field(self, tag: bytes) -> bytes:
        data, at = self._data, self._at
        if data[at : at + len(tag)] != tag:
            raise ValueError(f"field {tag.decode() or '(untagged)'} missing at byte {at}")
        at += len(tag)
        if at + 8 > len(data):
            raise ValueError(f"field {tag.decode() or '(untagged)'} is cut short")
        (n,) = _U64.unpack_from(data, at)
        at += 8
        if n > len(data) - at - 1 or data[at + n : at + n + 1] != b"|":
            raise ValueError(f"field {tag.decode() or '(untagged)'} claims {n} bytes past the blob's end")
        self._at = at + n + 1
        return data[at : at + n]

    def count(self, tag: bytes) -> int:
        raw = self.field(tag)
        if len(raw) != 8:
            raise ValueError(f"count {tag.decode()} is {len(raw)} bytes, not 8")
        return int(_U64.unpack(raw)[0])

    @property
    def done(self) -> bool:
        return self._at == len(self._data)


def _parse_blob(data: bytes) -> Blob:
    """Read the agent name and the declared regions out of NIXL metadata (full or partial).

    Raises: ValueError where the blob is not what `get_partial_agent_metadata` makes.
    """
    r = _Reader(data)
    agent = r.field(b"Agent").decode("utf-8", "strict")
    conns = r.count(b"Conns")
    if conns > 16:
        raise ValueError(f"{conns} connections")
    for _ in range(conns):
        r.field(b"t")
        r.field(b"c")
    if r.field(b"") != b"MemSection":
        raise ValueError("no MemSection")
    sections = r.count(b"nixlSecElms")
    if sections > 16:
        raise ValueError(f"{sections} sections")
    regions: list[Region] = []
    backend: list[bytes] = []
    for _ in range(sections):
        r.field(b"bknd")
        if r.field(b"nixlDList") != b"nixlSDList":
            raise ValueError("a section is not a list of registered regions")
        raw = r.field(b"t")
        if len(raw) != 4:
            raise ValueError(f"memory type of {len(raw)} bytes")
        mem = _MEM.get(int.from_bytes(raw, "little"))
        if mem is None:
            raise ValueError(f"memory type {int.from_bytes(raw, 'little')} (this transport registers DRAM and VRAM)")
        for _ in range(r.count(b"n")):
            elm = r.field(b"")
            if len(elm) < _DESC.size:
                raise ValueError(f"a region of {len(elm)} bytes")
            addr, nbytes, dev = _DESC.unpack_from(elm)
            if addr + nbytes > _MAX_ADDR:
                raise ValueError(f"region {addr:#x}+{nbytes} wraps around")
            regions.append(Region(mem, addr, nbytes, dev))
            backend.append(elm[_DESC.size :])
    if not r.done:
        raise ValueError("trailing bytes")
    return Blob(agent, tuple(regions), tuple(backend))


parse_blob = _Remembered(_parse_blob, lambda data, blob: len(data) + REGION_BYTES * len(blob.regions), PARSED_BYTES)


def check(info: TransferInfo[NixlMeta], producer_pid: int | None) -> None:
    """Raise TransferError unless `info.meta` is consistent with itself and `info.specs`.

    `producer_pid` is the pid of the ref's producer where the consumer knows it.
    Runs on: consumer, before anything reaches NIXL.
    """
    meta = info.meta
    try:
        _check(meta, info.specs, producer_pid)
    except _Bad as exc:
        raise TransferError(
            f"nixl fetch of {info.obj_id}: the ref's nixl metadata is not what its producer made "
            f"({exc}); nothing was read. Pass refs as rdt_async hands them out, unaltered",
            obj_id=info.obj_id,
        ) from None


class _Bad(Exception):
    pass


def _check(meta: Any, specs: Sequence[TensorSpec], producer_pid: int | None) -> None:
    if not isinstance(meta, NixlMeta):
        raise _Bad(f"metadata of type {type(meta).__name__}, not NixlMeta")
    for name, kind in (("agent", str), ("conn", bytes), ("regs", tuple), ("descs", tuple), ("host", str)):
        if type(getattr(meta, name)) is not kind:
            raise _Bad(f"{name} is a {type(getattr(meta, name)).__name__}, not {kind.__name__}")
    for name in ("slot", "token", "pid"):
        if type(getattr(meta, name)) is not int:
            raise _Bad(f"{name} is a {type(getattr(meta, name)).__name__}, not int")
    named = _NAME.fullmatch(meta.agent)
    if named is None or named["host"] != meta.host or int(named["pid"]) != meta.pid:
        raise _Bad(f"agent {meta.agent!r} is not the agent of pid {meta.pid} on {meta.host!r}")
    if producer_pid is not None and meta.pid != producer_pid:
        raise _Bad(f"its agent is in pid {meta.pid}, but the ref's producer is pid {producer_pid}")
    if not 0 < meta.token < 1 << 63:
        raise _Bad("liveness token out of range")
    blobs = (meta.conn, *meta.regs)
    for i, data in enumerate(blobs):
        what = _what(i)
        if type(data) is not bytes:
            raise _Bad(f"{what} is a {type(data).__name__}, not bytes")
        try:
            blob = parse_blob(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Bad(f"{what} is not NIXL metadata: {exc}") from None
        if blob.agent != meta.agent:
            raise _Bad(f"{what} names agent {blob.agent!r}, not {meta.agent!r}")
    regions, disagree = _index(blobs)
    if disagree is not None:
        raise _Bad(disagree)
    if len(meta.descs) != len(specs):
        raise _Bad(f"{len(meta.descs)} tensor descriptors for {len(specs)} tensors")
    for i, (desc, spec) in enumerate(zip(meta.descs, specs)):
        _check_desc(i, desc, spec, regions)
    if not _inside(regions, "DRAM", meta.slot, SLOT_BYTES, 0):
        raise _Bad(f"liveness slot {meta.slot:#x} is outside every region the producer registered")


def _check_desc(i: int, desc: Any, spec: TensorSpec, regions: _Index) -> None:
    if desc is None:
        if spec.nbytes:
            raise _Bad(f"tensor {i} ({spec}) has no descriptor")
        return
    if type(desc) is not tuple or len(desc) != 4 or not all(type(x) is int for x in desc[:3]) or type(desc[3]) is not str:
        raise _Bad(f"descriptor {i} is not (address, nbytes, device, memory)")
    addr, nbytes, dev, mem = desc
    if nbytes != spec.nbytes:
        raise _Bad(f"descriptor {i} is {nbytes} bytes, but tensor {i} ({spec}) is {spec.nbytes}")
    if (mem, dev) != _placed(spec.device):
        raise _Bad(f"descriptor {i} is {mem} of device {dev}, but tensor {i} is on {spec.device}")
    if not _inside(regions, mem, addr, nbytes, dev):
        raise _Bad(f"descriptor {i} ({addr:#x}+{nbytes}) is outside every region the producer registered")


# Per (memory, device): the starts and ends of the declared regions, merged and sorted.
_Index = dict[tuple[str, int], tuple[list[int], list[int]]]


def _what(i: int) -> str:
    """The field blob `i` of (conn, *regs) is."""
    return "the connection metadata" if i == 0 else f"region metadata {i - 1}"


def _make_index(blobs: tuple[bytes, ...]) -> tuple[_Index, str | None]:
    """The regions the (already parsed) blobs declare, merged, for bisecting; and where
    two declarations of one region disagree, which (else None)."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    declared: dict[Region, tuple[bytes, int]] = {}
    for i, data in enumerate(blobs):
        blob = parse_blob(data)
        for r, reaches in zip(blob.regions, blob.backend):
            first = declared.setdefault(r, (reaches, i))
            if first[0] != reaches:
                return {}, (
                    f"{_what(i)} declares {r.mem} region {r.addr:#x}+{r.nbytes} of device {r.dev} with other "
                    f"backend metadata than {'itself' if first[1] == i else _what(first[1])} does"
                )
            spans.setdefault((r.mem, r.dev), []).append((r.addr, r.addr + r.nbytes))
    out: _Index = {}
    for key, pairs in spans.items():
        starts: list[int] = []
        ends: list[int] = []
        for start, end in sorted(pairs):
            if starts and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        out[key] = (starts, ends)
    return out, None


def _index_size(blobs: tuple[bytes, ...], made: tuple[_Index, str | None]) -> int:
    return sum(map(len, blobs)) + SPAN_BYTES * sum(len(starts) for starts, _ in made[0].values())


_index = _Remembered(_make_index, _index_size, PARSED_BYTES)


@functools.lru_cache(maxsize=64)
def _placed(device: str) -> tuple[str, int]:
    """The NIXL memory kind and device index of a tensor on `device`."""
    d = torch.device(device)
    return ("DRAM", 0) if d.type == "cpu" else ("VRAM", d.index or 0)


def _inside(regions: _Index, mem: str, addr: int, nbytes: int, dev: int) -> bool:
    if addr < 0 or nbytes <= 0:
        return False
    starts, ends = regions.get((mem, dev), ((), ()))
    i = bisect.bisect_right(starts, addr) - 1
    return i >= 0 and addr + nbytes <= ends[i]
