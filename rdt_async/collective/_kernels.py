"""The collectives themselves, on a member's process group: one per part type.

A value's tensors are grouped by dtype (in order of first appearance, the same in every
member); each dtype's tensors are packed into one flat buffer, where they do not go to
the backend as they are, and take part in one collective. A kernel waits for its works
in the calling thread (never a loop's: members run parts in threads) and returns the
value this member keeps, or None where it keeps nothing (a broadcast bystander).
Runs on: member.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _tree
from .._membership import Group
from ._buffers import Buffers
from ._messages import Allgather, Allreduce, Broadcast, Part, ReduceScatter, Specs

_TORCH_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}

Inputs = list[torch.Tensor] | None  # the member's input tensors; None for broadcast receivers


def run(group: Group, part: Part, inputs: Inputs, buffers: Buffers, device: torch.device) -> Any:
    """Run `part` on `group`'s process group; return the value kept here, or None."""
    return _KERNELS[type(part)](group, part, inputs, buffers, device)


def _allreduce(group: Group, part: Allreduce, inputs: Any, buffers: Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.AllreduceOptions()
    opts.reduceOp = _reduce_op(part.op)
    shapes = [s for s, _ in part.specs]
    out: list[torch.Tensor] = list(inputs)
    works, copy_back = [], []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        if n == 0:
            if not part.inplace:
                for i in idx:
                    out[i] = torch.empty(shapes[i], dtype=dtype, device=device)
            continue
        buf = _flat(inputs, idx) if part.inplace else None
        if buf is None:
            buf = buffers.take(dtype, n, device)  # the result, or scratch for a packed inplace
            _pack(buf, [inputs[i] for i in idx])
            views = _views(buf, [shapes[i] for i in idx])
            if part.inplace:
                copy_back.append((idx, views))
            else:
                for i, v in zip(idx, views):
                    out[i] = v
        works.append(group.pg.allreduce([buf], opts))
    _wait(group, works)
    for idx, views in copy_back:
        for i, v in zip(idx, views):
            inputs[i].copy_(v)
    return _tree.unflatten(part.skeleton, out)


def _broadcast(group: Group, part: Broadcast, inputs: Any, buffers: Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = part.root, 0
    shapes = [s for s, _ in part.specs]
    source = group.rank == part.root
    out: list[torch.Tensor] = [None] * len(shapes)  # type: ignore[list-item]
    works = []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        buf = _flat(inputs, idx) if source and not part.keep else None  # send the input as it is
        if buf is None:
            buf = buffers.take(dtype, n, device)
            if source:
                _pack(buf, [inputs[i] for i in idx])
        for i, v in zip(idx, _views(buf, [shapes[i] for i in idx])):
            out[i] = v
        if n:
            works.append(group.pg.broadcast([_bytes(buf)], opts))
    _wait(group, works)
    return _tree.unflatten(part.skeleton, out) if part.keep else None


def _allgather(group: Group, part: Allgather, inputs: Any, buffers: Buffers, device: torch.device) -> Any:
    shapes = [s for s, _ in part.specs]
    size = part.size
    per_rank: list[list[torch.Tensor]] = [[None] * len(shapes) for _ in range(size)]  # type: ignore[list-item]
    works, held = [], []
    for dtype, idx in _buckets(part.specs):
        n = sum(_numel(shapes[i]) for i in idx)
        inp = _flat(inputs, idx)
        if inp is None:
            inp = buffers.take(dtype, n, device)
            _pack(inp, [inputs[i] for i in idx])
        out = buffers.take(dtype, n * size, device)
        for r in range(size):
            for i, v in zip(idx, _views(out, [shapes[i] for i in idx], r * n)):
                per_rank[r][i] = v
        held.append(inp)
        if n:
            works.append(group.pg._allgather_base(_bytes(out), _bytes(inp)))
    _wait(group, works)
    return [_tree.unflatten(part.skeletons[p], per_rank[r]) for p, r in enumerate(part.order)]


def _reduce_scatter(group: Group, part: ReduceScatter, inputs: Any, buffers: Buffers, device: torch.device) -> Any:
    dist = torch.distributed
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(part.op)
    size = part.size
    chunk_shapes = [(s[0] // size, *s[1:]) for s, _ in part.specs]
    out: list[torch.Tensor] = [None] * len(chunk_shapes)  # type: ignore[list-item]
    works, held = [], []
    for dtype, idx in _buckets(part.specs):
        per = sum(_numel(chunk_shapes[i]) for i in idx)
        inp = _flat(inputs, idx) if part.order == tuple(range(size)) else None
        if inp is None:
            # Rank r receives block r: put chunk p of every tensor where its holder's rank is.
            inp = buffers.take(dtype, per * size, device)
            for p, r in enumerate(part.order):
                _pack(inp, [inputs[i].chunk(size, 0)[p] for i in idx], r * per)
        res = buffers.take(dtype, per, device)
        for i, v in zip(idx, _views(res, [chunk_shapes[i] for i in idx])):
            out[i] = v
        held.append(inp)
        if per:
            works.append(group.pg._reduce_scatter_base(res, inp, opts))
    _wait(group, works)
    return _tree.unflatten(part.skeleton, out)


_KERNELS: dict[type[Part], Callable[..., Any]] = {
    Allreduce: _allreduce,
    Broadcast: _broadcast,
    Allgather: _allgather,
    ReduceScatter: _reduce_scatter,
}


def _buckets(specs: Specs) -> list[tuple[torch.dtype, list[int]]]:
    """Group tensor indices by dtype, in order of first appearance (the same in every member)."""
    by: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(specs):
        by.setdefault(dtype, []).append(i)
    return list(by.items())


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _views(buf: torch.Tensor, shapes: Sequence[Sequence[int]], start: int = 0) -> list[torch.Tensor]:
    out, off = [], start
    for shape in shapes:
        n = _numel(shape)
        out.append(buf.narrow(0, off, n).view(tuple(shape)))
        off += n
    return out


def _pack(buf: torch.Tensor, tensors: Sequence[torch.Tensor], start: int = 0) -> None:
    for v, t in zip(_views(buf, [tuple(t.shape) for t in tensors], start), tensors):
        v.copy_(t)


def _flat(tensors: Inputs, idx: list[int]) -> torch.Tensor | None:
    """The one tensor of a bucket as a flat view, if it can go to the backend as it is."""
    if tensors is None or len(idx) != 1 or not tensors[idx[0]].is_contiguous():
        return None
    return tensors[idx[0]].view(-1)


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """A flat buffer as its bytes, for a collective that only moves them (broadcast,
    allgather): any dtype goes (Gloo moves no int16, uint16/32/64, float8 or complex
    tensors: "Invalid scalar type", which broke the group in every member)."""
    return buf.view(torch.uint8)


def _wait(group: Group, works: list[Any]) -> None:
    """Wait for the works in this thread (never a loop's: members run parts in threads)."""
    for w in works:
        w.wait()
    if group.backend == "nccl":
        torch.cuda.current_stream().synchronize()


def _reduce_op(op: str) -> Any:
    return getattr(torch.distributed.ReduceOp, _TORCH_OPS[op])
