"""What a caller says to a group's members, one frozen dataclass per request.

A caller sends a message to a member's `rdt__group` control method (its `rdt`
concurrency group); the member answers it in `_member.serve`. Group lifecycle:
`Ping`, `Join`, `Leave`, `Break`. A collective: one `Part` per member,
of the collective's own type (`Allreduce`, `ReduceScatter`, `Allgather`, `Broadcast`),
which carries only what that collective needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._ray import await_ref

if TYPE_CHECKING:
    import torch

Specs = tuple[tuple[tuple[int, ...], "torch.dtype"], ...]  # (shape, dtype) of each tensor of a value


@dataclass(frozen=True)
class Ping:
    """Answer True: the member is alive and serves its `rdt` group."""


@dataclass(frozen=True)
class Join:
    """Join group `name` as `rank` of `size`, meeting the others through the group's
    rendezvous keys of this `creation` in the GCS; answer True."""

    name: str
    backend: str
    rank: int
    size: int
    members: tuple[str, ...]  # actor ids by rank
    creation: str  # random, per creation: its rendezvous keys' own part
    timeout_s: float


@dataclass(frozen=True)
class Leave:
    """Leave this `creation` of group `name` (give it up, where its join may not have
    begun there yet); answer whether this member was in it. Another creation of the
    name stays (a late Leave, or a stale handle's)."""

    name: str
    creation: str


@dataclass(frozen=True)
class Break:
    """Mark this `creation` of group `name` broken and abort its process group; answer
    whether it was there (a group made anew under the name is not touched)."""

    name: str
    creation: str
    why: str


@dataclass(frozen=True, kw_only=True)
class Part:
    """One member's share of a collective; answer the RDTObject produced there (or None)."""

    verb: ClassVar[str]  # the public verb, for messages: rdt.<verb>
    group: str
    creation: str  # which creation of the group, as its record says: another one refuses the part
    rank: int  # the member's rank, as the group's record says
    size: int
    specs: Specs
    obj_id: str | None  # the member's input; None for broadcast receivers
    transport: str = "auto"  # of the object produced here
    inline: tuple[bytes, ...] | None = None  # the input's bytes, where its ref carries them


@dataclass(frozen=True, kw_only=True)
class Allreduce(Part):
    verb = "allreduce"
    skeleton: Any  # of the result: the member's own value's
    op: str = "sum"
    inplace: bool = False


@dataclass(frozen=True, kw_only=True)
class ReduceScatter(Part):
    verb = "reduce_scatter"
    skeleton: Any
    order: tuple[int, ...]  # rank of the holder of refs[i]
    op: str = "sum"


@dataclass(frozen=True, kw_only=True)
class Allgather(Part):
    verb = "allgather"
    skeletons: tuple[Any, ...]  # every value's, in refs order
    order: tuple[int, ...]  # rank of the holder of refs[i]


@dataclass(frozen=True, kw_only=True)
class Broadcast(Part):
    verb = "broadcast"
    skeleton: Any
    root: int  # the source's rank
    keep: bool = True  # produce a result here (bystanders do not)


Message = Ping | Join | Leave | Break | Part


def send(actor: Any, msg: Message) -> Any:
    """Send `msg` to a member; return the ObjectRef of its answer."""
    return actor.rdt__group.remote(msg)


async def call(actor: Any, msg: Message) -> Any:
    """Send `msg` to a member and await its answer."""
    return await await_ref(send(actor, msg))
