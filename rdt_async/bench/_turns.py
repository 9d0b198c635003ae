"""How the paths of a bench take turns: the order of each round, a settle after each pass,
a path that breaks left out, and a path's actors ended before the next.

Paths run in turns so that a ratio compares passes of the same moment, not a path run
early against one run late on a machine that has changed meanwhile. A fixed rotation
is not enough: each path would always run right after the same other one, and inherit
its leftovers (an object store's frees, a dying process, warm or cold caches) every
round. The rounds follow a Williams design instead (`in_turns`): over one cycle of
rounds each path runs first, and right after every other path within a round, equally
often. The seams between rounds are not balanced (the last path of a round and the
first of the next), and fewer rounds than a cycle balance less: the settle after each
pass is what keeps one path's leftovers out of the next there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# After each pass the next waits as long as that pass took, within these bounds: what a
# path leaves to do once its pass is over (Ray freeing an object, a segment going back to
# its pool) scales with the bytes, and should not land in the next path's pass.
SETTLE_MIN_S, SETTLE_MAX_S = 0.01, 0.5


def williams(n: int) -> list[list[int]]:
    """The rows of a Williams design for `n` treatments: a Latin square (`n` rows; `2n`
    for odd `n`: each row and its reverse) in which every treatment follows every other
    one equally often (once; twice for odd `n`), and comes first equally often."""
    if n <= 0:
        return [[]]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:  # (an odd square alone is not balanced: its mirror completes it)
        rows = [r for row in rows for r in (row, row[::-1])]
    return rows


def in_turns(paths: Sequence[str], r: int) -> tuple[str, ...]:
    """The paths in round `r`'s order: row `r` of `williams(len(paths))`, the rows in
    turn (round `r` and round `r + len(rows)` run in the same order)."""
    rows = williams(len(paths))
    return tuple(paths[i] for i in rows[r % len(rows)])


def settle(took: float) -> None:
    """Wait after a pass that took `took` seconds (see SETTLE_MIN_S), before the next."""
    time.sleep(min(max(took, SETTLE_MIN_S), SETTLE_MAX_S))


@dataclasses.dataclass
class Turns(Generic[T]):
    """What `take_turns` ran: each path's cold pass (round 0, where there is one) and warm
    ones in round order, its place in each round it ran (0: first; the cold round's
    first), and for a path that raised, the round (0: cold) and what it raised."""

    cold: dict[str, T]
    warm: dict[str, list[T]]
    turns: dict[str, list[int]]
    broke: dict[str, tuple[int, Exception]]

    def why(self, name: str) -> str | None:
        """What broke `name` ("round 2: TypeError: ..."), or None."""
        if name not in self.broke:
            return None
        r, e = self.broke[name]
        return f"round {r}: {type(e).__name__}: {e}"[:500]


def take_turns(
    passes: Mapping[str, Callable[[], T]],
    rounds: int,
    *,
    cold: bool = True,
    pause: Callable[[float], None] = settle,
    broke: Callable[[str], None] = lambda name: None,
) -> Turns[T]:
    """Run `rounds` rounds of one pass of each path (`cold`: and a round 0 before them,
    kept apart), the paths of each round in `in_turns` order, `pause(seconds the pass
    took)` after each pass, whether it raised or not.

    A pass that raises (an Exception) ends its path: the passes it finished are kept, the
    error is in `Turns.broke`, `broke(name)` runs (close its actors), and later rounds
    leave it out. KeyboardInterrupt and the like end the whole run.
    """
    names = list(passes)
    out: Turns[T] = Turns({}, {n: [] for n in names}, {n: [] for n in names}, {})
    for r in range(rounds + (1 if cold else 0)):
        order = [n for n in in_turns(names, r) if n not in out.broke]
        for place, name in enumerate(order):
            started = time.perf_counter()
            try:
                got = passes[name]()
            except Exception as e:
                out.broke[name] = (r, e)
                try:
                    broke(name)
                except Exception as closing:  # (its passes are kept all the same, and the others run on)
                    e.add_note(f"closing its actors then failed too: {type(closing).__name__}: {closing}")
            else:
                if cold and r == 0:
                    out.cold[name] = got
                else:
                    out.warm[name].append(got)
                out.turns[name].append(place)
            finally:
                pause(time.perf_counter() - started)
    return out


def end_actors(actors: Iterable[Any], pids: Iterable[int], timeout: float = 60.0) -> None:
    """Kill `actors`, then wait until their processes (`pids`, on this machine: the bench's
    hosts share its process table) have exited, at most `timeout` seconds: a killed
    actor's teardown must not land in the next path's passes."""
    import ray

    for a in actors:
        ray.kill(a)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while not exited(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def exited(pid: int) -> bool:
    """Whether process `pid` is gone (or a zombie: it has ended, its parent not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
