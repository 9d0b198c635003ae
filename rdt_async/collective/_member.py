"""A member's side of its groups: it answers each message a caller sends.

Lifecycle messages go to the `gloo` transport (which makes process groups) and the
membership registry. A collective's part: look the input up in the store, run the
kernel for the part's type on the group's process group, and produce the result here
as an RDTObject (the caller's ref to this answer is then a ref to that object).
Runs on: member (a thread of its `rdt` group or of the I/O pool; never a loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
import torch

from .. import _object, _produce
from .._errors import CollectiveGroupError, ObjectFreedError, PeerDiedError, RDTError, translate
from .._membership import groups
from .._object import RDTObject
from .._store import store
from ..transports import inline
from . import _buffers, _kernels, _records
from ._messages import Break, Join, Leave, Message, Part, Ping


def serve(msg: Message) -> Any:
    """Answer one message from a caller (the member's `rdt` group calls this). Runs on: member."""
    from ..transports import gloo  # torch.distributed: only in processes that are members

    match msg:
        case Ping():
            return True
        case Join():
            gloo.join(
                msg.name,
                msg.backend,
                msg.rank,
                msg.size,
                kv=_records.GroupKV(msg.name, msg.creation),
                host=ray.util.get_node_ip_address(),  # Gloo listens on this node's Ray address only
                attempt=msg.creation,
                members=msg.members,
                timeout_s=msg.timeout_s,
            )
            return True
        case Leave(name=name, creation=creation):
            left = gloo.leave(name, creation)
            if left:
                _buffers.drop(name)
            return left
        case Break(name=name, creation=creation, why=why):
            group = groups.get(name)  # (a group made anew under the name is not the one that failed)
            return group is not None and group.creation == creation and groups.abort(group, why)
        case Part():
            return _take_part(msg)
    raise TypeError(f"not a group message: {msg!r}")


def _take_part(part: Part) -> RDTObject | None:
    """Run this member's part of a collective; return the RDTObject it produced here.

    Raises: CollectiveGroupError before any communication if this process is not the
    rank the caller expects; ObjectFreedError after taking part with zeros if the input
    was freed (so that the others do not wait); PeerDiedError or BackendError if the
    collective fails, which also marks the group broken here.
    """
    group = groups.require(part.group)
    if group.creation != part.creation:
        raise CollectiveGroupError(
            f"rdt.{part.verb}: group {part.group!r} was made anew since the caller looked it up (another "
            "creation of it is here now); issue the collective again"
        )
    if (group.rank, group.size) != (part.rank, part.size):
        raise CollectiveGroupError(
            f"rdt.{part.verb}: this member is rank {group.rank} of {group.size} in group {part.group!r}, "
            f"not rank {part.rank} of {part.size} (was the group recreated?)"
        )
    device = torch.device("cuda" if group.backend == "nccl" else "cpu")
    try:
        with _reading_inputs(part, device) as (inputs, freed):  # held: wait_tensor_freed waits
            value = _kernels.run(group, part, inputs, _buffers.of(part.group), device)
    except BaseException as exc:
        groups.mark_broken(group, f"rdt.{part.verb} failed in rank {group.rank}: {type(exc).__name__}")
        raise _collective_error(exc, part) from exc
    if freed:
        raise ObjectFreedError(
            f"rdt.{part.verb}: the input of rank {part.rank} (object {part.obj_id}) was freed before the "
            "collective; it took part with zeros",
            obj_id=part.obj_id,
        )
    if value is None:  # a broadcast bystander keeps nothing
        return None
    return _produce.produce(value, part.transport, owner=_object.here())


@contextlib.contextmanager
def _reading_inputs(part: Part, device: torch.device) -> Iterator[tuple[list[torch.Tensor] | None, bool]]:
    """Yield this member's inputs (zeros if they were freed) and whether they were freed."""
    if part.obj_id is None:
        yield None, False
        return
    if part.inline is not None:  # nothing kept here: the ref's bytes are the input
        yield [t.to(device) for t in inline.decode(part.inline, part.specs)], False
        return
    with store.reading(part.obj_id) as stored:
        if stored is None:
            yield [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in part.specs], True
        else:
            yield stored.tensors, False


def _collective_error(exc: BaseException, part: Part) -> BaseException:
    """Translate a failed collective: a lost connection means a peer went away."""
    from ..transports import gloo

    if isinstance(exc, RDTError):
        return exc
    if gloo.lost_peer(exc):
        return PeerDiedError(
            f"rdt.{part.verb} on group {part.group!r}: a peer went away during the collective "
            f"(it died, or the group was broken): {type(exc).__name__}: {str(exc)[:200]}"
        )
    return translate(exc, f"rdt.{part.verb} on group {part.group!r}", part.obj_id)
