"""Running one collective: send every member its part and wait for all of them.

Collectives on one group issued by this process run one at a time, in order (a lock
per group on the I/O loop). A member that fails in a way that leaves the others stuck
(it died, its collective failed) breaks the group in every survivor, so that none
waits for it; the caller raises the most telling failure. Runs on: the caller (I/O loop).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import ray

from .._errors import CollectiveGroupError, ObjectFreedError, PeerDiedError, translate
from .._ray import await_ref
from ._checks import Holder
from ._messages import Break, Part, call, send

BREAK_GRACE_S = 10.0  # after breaking a group, how long the caller waits for the survivors' answers

Calls = list[tuple[Holder, Part]]

# Per group, on the I/O loop: one collective at a time. Weak: a lock nobody holds or
# waits for is as good as a new one, so groups that come and go leave nothing behind.
_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


async def launch(verb: str, name: str, calls: Calls) -> list[Any]:
    """Start every member's part and wait for all; return the calls' ObjectRefs.

    The work runs in a task that holds the group's lock until every member answered,
    so that cancelling the caller never lets the next collective overtake this one.
    """
    task = asyncio.ensure_future(_run_locked(verb, name, calls))
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


async def _run_locked(verb: str, name: str, calls: Calls) -> list[Any]:
    lock = _locks.setdefault(name, asyncio.Lock())
    async with lock:
        refs = [send(h.actor, part) for h, part in calls]
        waits = [asyncio.ensure_future(await_ref(r)) for r in refs]
        for w in waits:
            w.add_done_callback(_retrieve)
        await _settle(verb, name, calls, waits)
        return refs


async def _settle(verb: str, name: str, calls: Calls, waits: list[Any]) -> None:
    """Wait for every member; on a failure other than a freed input, break the group."""
    pending, broken = set(waits), False
    while pending:
        done, pending = await asyncio.wait(
            pending, timeout=BREAK_GRACE_S if broken else None, return_when=asyncio.FIRST_EXCEPTION
        )
        if not done:
            break  # survivors did not answer in time after the break: they are failing anyway
        if not broken and any(_breaks(w.exception()) for w in done if w.exception()):
            broken = True
            dead = {i for i, w in enumerate(waits) if w.done() and _died(w.exception())}
            why = f"rdt.{verb} failed" + (f": rank {min(dead)} died" if dead else "")
            await _break_all([c for i, c in enumerate(calls) if i not in dead], why)
    failed = [(i, w.exception()) for i, w in enumerate(waits) if w.done() and w.exception()]
    if not failed:
        return
    i, exc = min(failed, key=lambda f: _severity(f[1]))
    holder, part = calls[i]
    what = f"rdt.{verb} on group {name!r}"
    if _died(exc):
        raise PeerDiedError(
            f"{what}: rank {part.rank} ({holder.label}) died during the collective; the group is broken "
            "in every survivor: destroy it and create a new one"
        ) from exc
    err = translate(exc, f"{what}, rank {part.rank} ({holder.label})", part.obj_id)
    raise err from exc


def _severity(exc: BaseException | None) -> int:
    """Order failures by what they tell the caller: a death first, a freed input last."""
    cause = getattr(exc, "cause", None)
    if _died(exc):
        return 0
    if isinstance(cause, CollectiveGroupError):
        return 1
    if isinstance(cause, ObjectFreedError):
        return 3
    return 2


def _died(exc: BaseException | None) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError)


def _breaks(exc: BaseException | None) -> bool:
    """Say whether a member's failure leaves others stuck in the collective (so: break it)."""
    return exc is not None and not isinstance(getattr(exc, "cause", None), ObjectFreedError)


async def _break_all(calls: Calls, why: str) -> None:
    """Break the group in each of these members: the creation their parts ran in, only."""

    async def one(h: Holder, part: Part) -> None:
        try:
            async with asyncio.timeout(BREAK_GRACE_S):
                await call(h.actor, Break(part.group, part.creation, why))
        except (Exception, TimeoutError):
            pass  # dead too, or unreachable: nothing to mark there

    await asyncio.gather(*(one(h, part) for h, part in calls))


def _retrieve(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # mark it retrieved: the caller may have stopped waiting
