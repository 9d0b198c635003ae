"""Where the user's code asked for a call: the line a warning of rdt_async names.

Runs on: any process, on the caller's thread or in the tasks it starts (which copy
`CALLER`).
"""

from __future__ import annotations

import contextvars
import os
import sys
import types
import warnings
from typing import Any

# Where the user's code asked for the fetch (file, line, module globals), where the fetch
# runs in a task whose frames lead back to asyncio or Ray, not to that line: set by
# `fetch_all` and `as_completed` (the user's line) and a method's fetched arguments (its
# definition).
CALLER: contextvars.ContextVar[tuple[str, int, dict[str, Any]] | None] = contextvars.ContextVar(
    "rdt_caller", default=None
)


def warn(message: str) -> None:
    """Warn (UserWarning) at `CALLER`, else at the first frame outside rdt_async (the user's
    line for a direct `await rdt.fetch` or `rdt.get`)."""
    where = CALLER.get() or user_line()
    if where is None:
        warnings.warn(message, UserWarning, stacklevel=1)  # (no frame of the user on this stack)
        return
    filename, lineno, module_globals = where
    warnings.warn_explicit(
        message, UserWarning, filename, lineno,
        module=module_globals.get("__name__"), registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_line() -> tuple[str, int, dict[str, Any]] | None:
    """(file, line, module globals) of the first frame outside rdt_async on this stack."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)
