"""Which collective groups this process is in: name, backend, rank, size, broken or not.

The registry is written by the member side of collective groups (joining, leaving,
breaking) and read by whoever needs to know what this process shares with another:
the `gloo`/`nccl` transports (the group's process group and its point-to-point tags),
a producer (which groups its objects can go over) and a consumer (is there a usable
group in common). It imports neither Ray nor torch: a process group is held, never
made, here (the `gloo` transport makes them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ._errors import CollectiveGroupError

TAG_LIMIT = 1 << 30  # Gloo tags are int32: a group's tags wrap here (bench's raw tags lie above)
MAX_TIMEOUT_S = 1e9  # a group's timeout_s is under this (~31 years): Gloo counts it in int64 nanoseconds
MIN_TIMEOUT_S = 1e-3  # and at least this: Gloo keeps it in whole milliseconds


@dataclass
class Group:
    """This process's membership of one collective group."""

    name: str
    backend: str
    rank: int
    size: int
    pg: Any
    store: Any = None  # the rendezvous store: NCCL reads it again for each new communicator
    members: tuple[str, ...] = ()  # who holds each rank (actor ids), where the creator said
    # Which creation of the group this is (the same in every member): tags start again at 1
    # in a group made anew under a name, so a send asked for in an earlier one (a request
    # left by a fetch that ended before) must never go out in this one.
    creation: str = ""
    timeout_s: float = 0.0  # bounds each of its operations (Gloo's work ends by then, aborted or not)
    broken: str | None = None
    _next_tag: int = 1
    _tag_lock: threading.Lock = field(default_factory=threading.Lock)

    def tags(self, n: int) -> int:
        """Reserve `n` consecutive tags for one transfer and return the first."""
        with self._tag_lock:
            if self._next_tag + n > TAG_LIMIT:
                self._next_tag = 1
            base, self._next_tag = self._next_tag, self._next_tag + n
        return base

    def check(self) -> None:
        """Raise CollectiveGroupError if the group is broken."""
        if self.broken:
            raise CollectiveGroupError(
                f"collective group {self.name!r} is broken ({self.broken}); destroy it with "
                "rdt.destroy_collective_group and create a new one on the survivors"
            )


class Groups:
    """The groups this process belongs to, by name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}

    def add(self, group: Group) -> None:
        """Record a group this process has joined.

        Raises: CollectiveGroupError if it is in a group of that name already.
        """
        with self._lock:
            if group.name in self._groups:
                raise CollectiveGroupError(f"this process is already in a group named {group.name!r}")
            self._groups[group.name] = group

    def leave(self, name: str, creation: str | None = None) -> bool:
        """Forget group `name` and end its process group; False if this process was not in it.

        `creation`: leave only that creation of it (a Leave that comes late, or from a
        stale handle, never ends a group made anew under its name); None: whichever it is.
        """
        with self._lock:
            group = self._groups.get(name)
            if group is None or (creation is not None and group.creation != creation):
                return False
            del self._groups[name]
        try:
            if group.broken:
                group.pg.abort()
            else:
                group.pg.shutdown()
        except Exception:
            pass
        _close_store(group)
        return True

    def get(self, name: str) -> Group | None:
        with self._lock:
            return self._groups.get(name)

    def require(self, name: str) -> Group:
        """Return group `name`, usable.

        Raises: CollectiveGroupError if this process is not in it, or it is broken.
        """
        group = self.get(name)
        if group is None:
            raise CollectiveGroupError(f"this process is not in collective group {name!r} (destroyed?)")
        group.check()
        return group

    def abort(self, group: Group, why: str) -> bool:
        """Mark `group` broken and abort its process group: its pending work ends now.

        Only while it is this process's group of its name: one left already (a fetch from
        it ended late) has no work to end, and a group made anew under the name is not it.
        """
        with self._lock:
            if self._groups.get(group.name) is not group:
                return False
            if not group.broken:
                group.broken = why
        _close_store(group)  # a wait on it (NCCL making a communicator) ends too
        try:
            group.pg.abort()
        except Exception:
            pass
        return True

    def mark_broken(self, group: Group, why: str) -> None:
        """Mark `group` broken (the first reason stays); a group made anew under its name
        is another Group, untouched."""
        with self._lock:
            if not group.broken:
                group.broken = why

    def memberships(self) -> dict[str, tuple[str, int]]:
        """Return name -> (backend, rank) of the groups this process is in and can use."""
        with self._lock:
            return {g.name: (g.backend, g.rank) for g in self._groups.values() if not g.broken}

    def broken(self) -> list[Group]:
        """Return the groups of this process that are marked broken."""
        with self._lock:
            return [g for g in self._groups.values() if g.broken]


def check_timeout(timeout_s: Any) -> None:
    """Raise CollectiveGroupError unless `timeout_s` is a finite number of seconds over 0.

    It bounds each operation of the group, checked where it is given: Gloo refused a
    negative one in every member, and failed every operation of a group given 0.
    """
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not ok or not MIN_TIMEOUT_S <= timeout_s < MAX_TIMEOUT_S:
        raise CollectiveGroupError(
            f"timeout_s bounds each operation of a collective group: a number of seconds from {MIN_TIMEOUT_S:g} "
            f"(Gloo counts whole milliseconds: less is 0, no time at all) and under {MAX_TIMEOUT_S:.0e}, not {timeout_s!r}"
        )


def _close_store(group: Group) -> None:
    close = getattr(group.store, "close", None)
    if close is not None:
        close()


groups = Groups()
