"""One progress bar on stderr over a bench run (tqdm, where installed; silent without it)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

HINT = "(`pip install rdt_async[bench]` adds a progress bar and plots)"


class Progress:
    """A bar over a run's steps that shows the step under way.

    `enabled=None` shows it where stderr is a terminal (tqdm's own `disable=None`),
    False never. Without tqdm there is no bar; notes still go to stderr.
    """

    def __init__(self, enabled: bool | None = None, *, unit: str = "case") -> None:
        self._bar: Any = None
        self._make: Any = None  # the bar, made when the first steps are planned
        if enabled is False:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if sys.stderr.isatty():
                print(HINT, file=sys.stderr)
            return
        self._make = functools.partial(tqdm, unit=unit, file=sys.stderr, dynamic_ncols=True,
                                       disable=None if enabled is None else not enabled)

    def add(self, steps: int) -> None:
        """Plan `steps` more steps."""
        if self._bar is None and self._make is not None and steps > 0:
            self._bar, self._make = self._make(total=steps), None
        elif self._bar is not None:
            self._bar.total += steps
            self._bar.refresh()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Show `what` as the step under way; count it done when the block ends."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)
        yield
        self.skip(1)

    def skip(self, steps: int) -> None:
        """Count `steps` planned steps done without running them."""
        if self._bar is not None and steps > 0:
            self._bar.update(steps)

    def note(self, message: str) -> None:
        """Print a line on stderr above the bar."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str("")
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
