"""Creating and destroying collective groups. Runs on: the caller (driver or any actor).

The group's name is claimed in Ray's GCS (`_records`), and every member joins
concurrently through its `rdt` concurrency group, so members busy in user methods still
join. They meet through the group's rendezvous keys in the GCS (no store of torch's, no
port opened for it), which the caller deletes when the group is destroyed or its
creation fails.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _io, _ray
from .._errors import CollectiveGroupError
from .._membership import check_timeout
from . import _records
from ._messages import Join, Leave, Ping, call
from ._twins import blocking_twin

BACKENDS = ("gloo", "nccl")
PING_TIMEOUT_S = 60.0  # actors still starting answer late; dead ones fail at once


@dataclass(frozen=True)
class CollectiveGroup:
    """A collective group: its name, backend and member actors (rank = position).

    `creation`: which creation of the name it is (`create_collective_group` sets it), so
    that a handle that outlived its group never touches a group made anew under the name.
    A handle rebuilt by hand, `CollectiveGroup(name, backend, actors)`, has none: it
    stands for whichever group holds the name when it is used.
    """

    name: str
    backend: str
    actors: tuple[Any, ...]
    creation: str | None = None

    def __repr__(self) -> str:
        return f"CollectiveGroup({self.name!r}, backend={self.backend!r}, {len(self.actors)} members)"


async def create_collective_group_async(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Async twin of `create_collective_group`; never blocks the loop."""
    actors = tuple(actors)
    _validate(actors, backend, name, timeout_s)
    name = name or f"{backend}-{secrets.token_hex(6)}"
    members = tuple(a._actor_id.hex() for a in actors)
    creation = secrets.token_hex(8)
    record = {"backend": backend, "actors": list(members), "creation": creation}
    claimed = joining = False
    try:
        # Every member answers first: a record names only actors Ray knew (see live_members).
        await _ping_all(actors, name)
        # The claim runs to its end through a cancel, which then takes effect: a claim
        # made but abandoned would keep the name taken for good.
        claim = asyncio.ensure_future(_io.to_thread(_records.claim, name, record, purpose=_io.CALLS))
        cancelled = await _io.shielded(claim)
        claimed = not claim.result()
        if cancelled:
            raise asyncio.CancelledError
        if not claimed:
            raise CollectiveGroupError(
                f"a collective group named {name!r} exists: destroy it (rdt.destroy_collective_group(group) with "
                f"its CollectiveGroup, or one rebuilt as rdt.CollectiveGroup({name!r}, backend, actors); or by its "
                f"name once its members are gone: rdt.destroy_collective_group({name!r})), or pick another name"
            )
        joining = True
        await asyncio.gather(
            *(_join(a, Join(name, backend, rank, len(actors), members, creation, timeout_s)) for rank, a in enumerate(actors))
        )
    except BaseException as exc:
        if claimed:  # a second cancel leaves the undo running
            await asyncio.shield(asyncio.ensure_future(_undo(actors if joining else (), name, creation)))
        if isinstance(exc, (CollectiveGroupError, asyncio.CancelledError)):
            raise  # (a cancel, or the caller's timeout, stays one)
        raise CollectiveGroupError(f"creating collective group {name!r} failed: {cause(exc)}") from exc
    return CollectiveGroup(name, backend, actors, creation)


@blocking_twin(create_collective_group_async)
def create_collective_group(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Make a collective group of `rdt.remote` actors; rank i is `actors[i]`.

    Callable from the driver or any actor (blocking; use `create_collective_group_async`
    on an event loop). `timeout_s` (seconds, over 0) bounds each of the group's
    operations, not this call.
    Raises: CollectiveGroupError (a dead member, or one that failed to join, named by
    rank; a name in use; a bad backend or timeout_s).
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


async def destroy_collective_group_async(group: CollectiveGroup | str, /) -> None:
    """Async twin of `destroy_collective_group`."""
    if isinstance(group, str):
        await _io.to_thread(_release_left_behind, group, purpose=_io.CALLS)
        return
    creation = group.creation
    if creation is None:  # a handle rebuilt by hand: the group that holds the name now
        rec = await _io.to_thread(_records.record, group.name, purpose=_io.CALLS)
        if rec is None:
            return
        creation = rec["creation"]
    await _leave_all(group.actors, group.name, creation)
    await _io.to_thread(_forget, group.name, creation, purpose=_io.CALLS)


@blocking_twin(destroy_collective_group_async)
def destroy_collective_group(group: CollectiveGroup | str, /) -> None:
    """Tear a group down on every live member and free its name (dead members are skipped).

    Only the creation the handle came from: destroying a handle twice, or one whose
    group was destroyed and made anew under its name, leaves the new group alone.
    By name (a str): free the name of a group left behind, whose members are all dead
    (its creator's job ended without destroying it); a group with live members must be
    destroyed through a `CollectiveGroup`, so that they leave it.
    Raises: CollectiveGroupError for a name whose group has live members.
    """
    raise NotImplementedError  # never runs: blocking_twin replaces it


def _release_left_behind(name: str) -> None:
    """Free the name of a group whose members are all dead (its creator's job ended, say)."""
    rec = _records.record(name)
    if rec is None:
        return
    live = _records.live_members(rec)
    if live:
        raise CollectiveGroupError(
            f"collective group {name!r} still has live members (ranks {', '.join(map(str, live))}): destroy it "
            f"with the CollectiveGroup that create_collective_group returned, or one rebuilt as "
            f"rdt.CollectiveGroup({name!r}, {rec['backend']!r}, actors) with its actors by rank, so that they "
            "leave it"
        )
    _forget(name, rec["creation"])


def _forget(name: str, creation: str) -> None:
    """Delete the group's rendezvous keys, then free its name (in that order: a new group
    of that name never meets them); nothing if the name is free, or another creation's."""
    rec = _records.record(name)
    if rec is None or rec["creation"] != creation:
        return
    _records.purge(name)
    _records.release(name, creation)


NAME_LIMIT = 256  # characters of a group's name


def _validate(actors: tuple[Any, ...], backend: str, name: str | None, timeout_s: float) -> None:
    if name is not None and (not isinstance(name, str) or len(name) > NAME_LIMIT):
        raise CollectiveGroupError(
            f"a group's name is a str of at most {NAME_LIMIT} characters, not {type(name).__name__} "
            f"{str(name)[:40]!r}; or leave name=None for a random one"
        )
    if backend not in BACKENDS:
        raise CollectiveGroupError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    check_timeout(timeout_s)
    if not actors:  # (one is a group too, as in Ray: a producer passing refs to itself)
        raise CollectiveGroupError("a collective group needs at least 1 actor, got none")
    seen: dict[Any, int] = {}
    for i, a in enumerate(actors):
        if not _ray.is_actor_handle(a):
            raise CollectiveGroupError(f"member {i} is a {type(a).__name__}, not an actor handle")
        if not hasattr(a, "rdt__group"):
            raise CollectiveGroupError(f"member {i} is not an rdt.remote actor: decorate its class with @rdt.remote")
        if a._actor_id in seen:
            raise CollectiveGroupError(
                f"an actor appears twice in the group: actors[{seen[a._actor_id]}] and actors[{i}] are both "
                f"actor {a._actor_id.hex()[:8]}; list each member once"
            )
        seen[a._actor_id] = i


async def _join(actor: Any, msg: Join) -> None:
    """Have one member join; a failure names it (its rank and actor)."""
    try:
        await call(actor, msg)
    except Exception as exc:  # (not a cancel of the caller's: that is no member's fault)
        raise CollectiveGroupError(
            f"creating collective group {msg.name!r} failed in member {msg.rank} (actor "
            f"{actor._actor_id.hex()[:8]}): {cause(exc)}"
        ) from exc


async def _undo(actors: Sequence[Any], name: str, creation: str) -> None:
    """A creation that did not finish: members leave (or never join), its keys go, the name is free again."""
    await _leave_all(actors, name, creation)
    await _io.to_thread(_forget, name, creation, purpose=_io.CALLS)


async def _ping_all(actors: tuple[Any, ...], name: str) -> None:
    async def ping(i: int, a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await call(a, Ping())
        except Exception as exc:  # (not a cancel of the caller's: that is no member's fault)
            raise CollectiveGroupError(
                f"cannot create group {name!r}: member {i} ({a._actor_id.hex()[:8]}) is dead or "
                f"unreachable ({cause(exc)})"
            ) from exc

    await asyncio.gather(*(ping(i, a) for i, a in enumerate(actors)))


async def _leave_all(actors: Sequence[Any], name: str, creation: str) -> None:
    async def leave(a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await call(a, Leave(name, creation))
        except Exception:
            pass  # dead or unreachable: nothing left to tear down there

    await asyncio.gather(*(leave(a) for a in actors))


def cause(exc: BaseException) -> str:
    """Say what went wrong in a member call: the remote error where Ray wrapped one."""
    inner = getattr(exc, "cause", None) or exc
    return f"{type(inner).__name__}: {inner}"
