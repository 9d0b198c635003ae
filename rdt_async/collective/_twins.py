"""Blocking twins of the async verbs, made by one decorator rather than written by hand."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from .. import _io

P = ParamSpec("P")
T = TypeVar("T")


def blocking_twin(
    async_fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Make the decorated `def` the blocking twin of `async_fn`; its body never runs.

    The `def` keeps the signature and docstring (for readers and the docs). The twin
    runs `async_fn` on the I/O loop and waits for it in this thread; called on a thread
    whose event loop is running, it raises a RuntimeError naming the async twin instead
    of blocking that loop.
    Raises: TypeError at decoration if the two signatures differ.
    """

    def make(declared: Callable[P, T]) -> Callable[P, T]:
        ours, theirs = inspect.signature(declared).parameters, inspect.signature(async_fn).parameters
        if list(ours.values()) != list(theirs.values()):
            raise TypeError(f"{declared.__name__}{inspect.signature(declared)} does not match {async_fn.__name__}")
        verb, twin = declared.__name__, async_fn.__name__

        @functools.wraps(declared)
        def blocking(*args: P.args, **kwargs: P.kwargs) -> T:
            if _io.running_loop() is not None:
                raise RuntimeError(f"rdt.{verb}() would block this thread's event loop; await rdt.{twin}() here")
            return _io.start(async_fn(*args, **kwargs)).result()

        return blocking

    return make
