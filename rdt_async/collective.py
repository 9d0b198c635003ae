"""Collective groups: standalone Gloo/NCCL process groups over rdt.remote actors.

A group is made from the driver or any actor: its name is claimed in Ray's GCS (so a
name is unique in the cluster), rank 0 hosts the rendezvous store on its node's
address, and every member joins concurrently through its `rdt` concurrency group, so
members busy in user methods still join. Members keep their process group in
`transports.gloo.groups`; transfers between members then go over it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv

from . import _io
from ._errors import CollectiveGroupError

KV_NAMESPACE = "rdt_async"
BACKENDS = ("gloo", "nccl")
PING_TIMEOUT_S = 60.0  # actors still starting answer late; dead ones fail at once


@dataclass(frozen=True)
class CollectiveGroup:
    """A collective group: its name, backend and member actors (rank = position)."""

    name: str
    backend: str
    actors: tuple[Any, ...]

    def __repr__(self) -> str:
        return f"CollectiveGroup({self.name!r}, backend={self.backend!r}, {len(self.actors)} members)"


def create_collective_group(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Make a collective group of `rdt.remote` actors; rank i is `actors[i]`.

    Callable from the driver or any actor (blocking; use `create_collective_group_async`
    on an event loop). `timeout_s` bounds the group's operations.
    Raises: CollectiveGroupError (a dead member, a name in use, a bad backend).
    """
    _no_loop("create_collective_group")
    return _io.submit(create_collective_group_async(actors, backend=backend, name=name, timeout_s=timeout_s)).result()


async def create_collective_group_async(
    actors: Sequence[Any], /, *, backend: str = "gloo", name: str | None = None, timeout_s: float = 30.0
) -> CollectiveGroup:
    """Async twin of `create_collective_group`; never blocks the loop."""
    actors = tuple(actors)
    _validate(actors, backend)
    name = name or f"{backend}-{secrets.token_hex(6)}"
    if await _io.to_thread(_claim, name):
        raise CollectiveGroupError(f"a collective group named {name!r} exists; destroy it or pick another name")
    try:
        await _ping_all(actors, name)
        host, port = await _await(actors[0].rdt__group.remote("host", name))
        await asyncio.gather(
            *(
                _await(a.rdt__group.remote("join", name, backend, rank, len(actors), host, port, timeout_s))
                for rank, a in enumerate(actors)
            )
        )
    except BaseException as exc:
        await _leave_all(actors, name)
        await _io.to_thread(_release, name)
        if isinstance(exc, CollectiveGroupError):
            raise
        raise CollectiveGroupError(f"creating collective group {name!r} failed: {_cause(exc)}") from exc
    return CollectiveGroup(name, backend, actors)


def destroy_collective_group(group: CollectiveGroup | str, /) -> None:
    """Tear a group down on every live member and free its name (dead members are skipped)."""
    _no_loop("destroy_collective_group")
    _io.submit(destroy_collective_group_async(group)).result()


async def destroy_collective_group_async(group: CollectiveGroup | str, /) -> None:
    """Async twin of `destroy_collective_group`."""
    if isinstance(group, str):
        raise TypeError("pass the CollectiveGroup that create_collective_group returned")
    await _leave_all(group.actors, group.name)
    await _io.to_thread(_release, group.name)


def serve(op: str, *args: Any) -> Any:
    """Run a group operation in a member (its `rdt` group calls this). Runs on: member."""
    from .transports.gloo import groups

    if op == "ping":
        return True
    if op == "host":
        host = ray.util.get_node_ip_address()
        return host, groups.host_store(args[0], host)
    if op == "join":
        groups.join(*args)
        return True
    if op == "leave":
        return groups.leave(args[0])
    raise ValueError(f"unknown group operation {op!r}")


def _validate(actors: tuple[Any, ...], backend: str) -> None:
    if backend not in BACKENDS:
        raise CollectiveGroupError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if len(actors) < 2:
        raise CollectiveGroupError(f"a collective group needs at least 2 actors, got {len(actors)}")
    ids = []
    for i, a in enumerate(actors):
        if not isinstance(a, ray.actor.ActorHandle):
            raise CollectiveGroupError(f"member {i} is a {type(a).__name__}, not an actor handle")
        try:
            a.rdt__group
        except AttributeError:
            raise CollectiveGroupError(
                f"member {i} is not an rdt.remote actor: decorate its class with @rdt.remote"
            ) from None
        ids.append(a._actor_id)
    if len(set(ids)) != len(ids):
        raise CollectiveGroupError("an actor appears twice in the group")


async def _ping_all(actors: tuple[Any, ...], name: str) -> None:
    async def ping(i: int, a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await _await(a.rdt__group.remote("ping"))
        except BaseException as exc:
            raise CollectiveGroupError(
                f"cannot create group {name!r}: member {i} ({a._actor_id.hex()[:8]}) is dead or "
                f"unreachable ({_cause(exc)})"
            ) from exc

    await asyncio.gather(*(ping(i, a) for i, a in enumerate(actors)))


async def _leave_all(actors: Sequence[Any], name: str) -> None:
    async def leave(a: Any) -> None:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await _await(a.rdt__group.remote("leave", name))
        except BaseException:
            pass  # dead or unreachable: nothing left to tear down there

    await asyncio.gather(*(leave(a) for a in actors))


async def _await(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


def _claim(name: str) -> bool:
    """Claim `name` in the GCS; True if it was taken already."""
    return bool(internal_kv._internal_kv_put(f"group/{name}", b"1", overwrite=False, namespace=KV_NAMESPACE))


def _release(name: str) -> None:
    internal_kv._internal_kv_del(f"group/{name}", namespace=KV_NAMESPACE)


def _no_loop(verb: str) -> None:
    if _io.running_loop() is not None:
        raise RuntimeError(f"rdt.{verb}() would block this thread's event loop; await rdt.{verb}_async() here")


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
