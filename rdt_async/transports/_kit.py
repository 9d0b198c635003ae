"""A toolkit for writing transports: settings, devices, and where a receive lands.

None of it is the interface (`_base.py`): a transport may use it or not. What the core
uses as well (process liveness, byte layouts, views, copies) is the core's, in
`rdt_async/_local.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np
import torch

from .. import _alloc
from ._base import TensorSpec, Unreachable


def local_device(device: str) -> torch.device:
    """Where a fetched tensor produced on `device` lands here: the same device where this
    process has it, else its current CUDA device, or the CPU in a process without CUDA."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if d.index is None or d.index >= torch.cuda.device_count():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def or_none(buffers: Sequence[torch.Tensor | None] | None, n: int) -> Sequence[torch.Tensor | None]:
    """The caller's `into=` buffers, or None for each of the `n` tensors."""
    return buffers if buffers else [None] * n


def digest(obj_id: str, exports: Sequence[Any]) -> int:
    """A signed int64 digest of an object's id and what its producer exported for it (tensor
    descriptors, IPC handles): a producer keeps it beside the object's liveness token where
    consumers read it, and a consumer refuses a ref whose exports do not give it (altered to
    read other memory of the producer). `exports` must have a stable repr."""
    return _int64(repr((obj_id, tuple(exports))).encode("utf-8", "surrogatepass"))


def sizes_digest(obj_id: str, sizes: Sequence[int]) -> int:
    """A signed int64 digest of an object's id and its tensors' byte sizes: a consumer sends
    it with a request (the sizes its ref's specs give), a producer that serves requests
    itself compares it with its own tensors' and refuses another (a ref altered to read
    more bytes than a tensor has, or fewer: a prefix). Cheap for thousands of tensors."""
    return _int64(obj_id.encode("utf-8", "surrogatepass") + np.fromiter(sizes, dtype=np.int64, count=len(sizes)).tobytes())


def _int64(what: bytes) -> int:
    """A signed int64 hash of `what` (as a liveness slot's word holds it)."""
    return int.from_bytes(hashlib.blake2b(what, digest_size=8).digest(), "little", signed=True)


def int_setting(env: str, default: int, minimum: int, meaning: str) -> int:
    """The integer environment variable `env` (`default` if unset), at least `minimum`.

    Raises: ValueError naming the variable and `meaning` (what to give) otherwise.
    """
    raw = os.environ.get(env, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{env}={raw!r}: give {meaning}")
    return value


def landing_buffers(
    specs: Sequence[TensorSpec], buffers: Sequence[torch.Tensor | None] | None, device: str = "cpu"
) -> list[torch.Tensor]:
    """Return where each tensor of a receive lands.

    The caller's buffer where it is contiguous and on `device` (a native library handed
    memory of another device would fault or fail mid-transfer), else a fresh one (from
    the reuse cache on CPU): `delivered` copies it over. Runs on: consumer.
    """
    given = or_none(buffers, len(specs))
    kind = torch.device(device).type
    return [b if lands_in(b, kind) else _alloc.empty(s.shape, s.dtype, device) for b, s in zip(given, specs)]


def lands_in(b: torch.Tensor | None, kind: str) -> TypeGuard[torch.Tensor]:
    """Whether a receive on a device of `kind` lands in the caller's buffer `b` itself
    (`landing_buffers`); where not, it lands elsewhere and `delivered` copies it over."""
    return b is not None and b.is_contiguous() and b.device.type == kind


def delivered(buffers: list[torch.Tensor] | None, landed: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return the caller's buffers, filled from where they did not land, or `landed`."""
    if buffers is None:
        return landed
    for b, d in zip(buffers, landed):
        if b is not d:
            b.copy_(d)
    return list(buffers)


GREETING_BYTES = 16  # a listener's greeting (`greeting`)


def greeting(token: bytes, label: bytes) -> bytes:
    """A producer's listener's first message (`tcp`, `ucxx`, each with its `label`): proof
    that it knows `token`, which its refs carry, revealing nothing of it. A consumer sends
    nothing before it: a ref's address and token are input from another process, and a
    request sent to whatever listens there would hand a crafted ref's bytes to any
    service it names."""
    return hmac.digest(token, label, "sha256")[:GREETING_BYTES]


def another_listener(where: str, transport: str) -> Unreachable:
    """The error for a listener at `where` whose greeting proves another token. Not lasting:
    a ref with another token takes `transport` away from no live producer there."""
    return Unreachable(
        f"the listener at {where} is not the producer's {transport} listener (its greeting is not the one "
        "the ref's token asks for); nothing was sent to it: the producer is gone and another process "
        "listens there, or the ref was altered",
        lasting=False,
    )
