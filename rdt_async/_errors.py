"""The error tree of rdt_async, and the one place native errors are translated."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

# The longest message an error keeps: what a ref carries is another process's input, and a
# crafted field (a million offsets, a megabyte of segment name) must not become a message
# of megabytes in every log and traceback it reaches.
MAX_MESSAGE = 4000


class RDTError(Exception):
    """Base class of every error rdt_async raises."""

    def __init__(self, message: str, *, obj_id: str | None = None) -> None:
        if len(message) > MAX_MESSAGE:  # its head says what was refused, its tail the fix
            head, tail = MAX_MESSAGE - 1000, 800
            message = f"{message[:head]} [... {len(message) - head - tail} characters cut ...] {message[-tail:]}"
        super().__init__(message)
        self.obj_id = obj_id

    def __reduce__(self) -> tuple[Any, ...]:  # keep obj_id across Ray's pickling of task errors
        return (_rebuild, (type(self), str(self), self.obj_id))


def _rebuild(cls: type[RDTError], message: str, obj_id: str | None) -> RDTError:
    return cls(message, obj_id=obj_id)


class TransportUnavailableError(RDTError):
    """A transport is not installed, not usable on this device, or not reachable."""


class ObjectFreedError(RDTError):
    """The object was freed (explicitly or because its producer let it go)."""


class TransferError(RDTError):
    """A transfer started and did not complete."""


class PeerDiedError(TransferError):
    """The other side of a transfer died."""


class TransferAbortedError(TransferError):
    """The transfer was aborted (by a cancel, or by the backend)."""


class BackendError(TransferError):
    """The transport's native library reported an error."""


class CollectiveGroupError(RDTError):
    """A collective group cannot be created, used or destroyed."""


class NotFetchedError(TypeError, AttributeError):
    """An RDTObject used as its value (indexed, iterated, its tensor or dict attributes read).

    A TypeError, as for any wrong use of a type; an AttributeError too, so that
    `hasattr(obj, "shape")` stays False rather than raising.
    """


class NativeErrors(Protocol):
    """What `translate` asks of a transport (`Transport.native_error`)."""

    @property
    def name(self) -> str: ...

    def native_error(self, exc: BaseException) -> type[RDTError] | None: ...


def translate(
    exc: BaseException,
    what: str,
    obj_id: str | None = None,
    *,
    user_code: bool = False,
    transport: NativeErrors | None = None,
) -> BaseException:
    """Map a native error raised while doing `what` to the rdt_async tree.

    The result is meant for ``raise translate(exc, ...) from exc``. Errors that are
    already ours, cancellation and timeouts pass through unchanged; with `user_code`
    (resolving a method's ref), so does what the method raised, as `ray.get` raises it
    (a `RayTaskError` that is also an instance of the method's exception class).
    Ray's errors are mapped here; a `transport`'s own, by what its `native_error` says.
    """
    ray_exceptions = sys.modules.get("ray.exceptions")
    cause = getattr(exc, "cause", None)
    if ray_exceptions is not None and isinstance(exc, ray_exceptions.RayTaskError) and isinstance(cause, RDTError):
        # One of ours raised in another process. Ray's RayTaskError(ObjectFreedError) is an
        # instance of ours too, but its type name and message are Ray's: rebuild the original.
        rebuilt: RDTError = type(cause)(str(cause), obj_id=cause.obj_id)
        return rebuilt
    if isinstance(exc, (RDTError, TimeoutError, KeyboardInterrupt, SystemExit)):
        return exc
    if type(exc).__name__ == "CancelledError":
        return exc
    if ray_exceptions is not None:
        if isinstance(exc, ray_exceptions.RayTaskError) and user_code:
            return exc  # type: ignore[no-any-return]  # ray.exceptions, found in sys.modules, is Any
        if isinstance(exc, (ray_exceptions.RayActorError, ray_exceptions.ActorDiedError)):
            return PeerDiedError(f"{what}: the producer died ({exc})", obj_id=obj_id)
        if isinstance(exc, ray_exceptions.GetTimeoutError):
            return TimeoutError(f"{what}: timed out")
        if isinstance(exc, ray_exceptions.ObjectLostError):
            return ObjectFreedError(f"{what}: the object was lost ({exc})", obj_id=obj_id)
        if isinstance(exc, ray_exceptions.RayError):
            return BackendError(f"{what} failed in Ray: {exc}", obj_id=obj_id)
    native = f"{type(exc).__name__}: {exc}"
    ours = transport.native_error(exc) if transport is not None else None
    if transport is None or ours is None:
        return BackendError(f"{what} failed: {native}", obj_id=obj_id)
    if ours is PeerDiedError:
        return PeerDiedError(f"{what}: the producer disconnected ({native})", obj_id=obj_id)
    if ours is ObjectFreedError:
        return ObjectFreedError(f"{what}: the object was freed, or its producer died ({native})", obj_id=obj_id)
    return ours(f"{what} failed in {transport.name}: {native}", obj_id=obj_id)


class translating:
    """Translate native errors raised in the block (see `translate`), keeping the chain.

    A class, not a generator: every fetch enters one, and a small fetch pays for each call.
    """

    __slots__ = ("obj_id", "transport", "user_code", "what")

    def __init__(
        self, what: str, obj_id: str | None = None, *, user_code: bool = False, transport: NativeErrors | None = None
    ) -> None:
        self.what, self.obj_id, self.user_code, self.transport = what, obj_id, user_code, transport

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            return
        err = translate(exc, self.what, self.obj_id, user_code=self.user_code, transport=self.transport)
        if err is exc:
            return  # (raised on as it is)
        exc.__suppress_context__ = True  # what the native error met on its way is internal: one chain
        raise err from exc


def one_chain(exc: BaseException) -> None:
    """Leave `exc` one chain to show: itself, and the native error that caused it, if any.

    An error re-raised inside rdt_async as another of ours (a transport's failure found to
    be a death: PeerDiedError from BackendError from the native error) says the inner one
    in its message already: its cause becomes the native error at the bottom, whose own
    context (the retries and re-raises it passed through) is not shown. Errors that are
    not ours are left alone. Costs nothing unless a fetch failed.
    """
    if not isinstance(exc, RDTError):
        return
    cause = exc.__cause__
    while cause is not None and (isinstance(cause, RDTError) or getattr(cause, "says_its_cause", False)):
        cause = cause.__cause__  # (a transport's wrapper that repeats the native error: Unreachable)
    exc.__cause__ = cause
    exc.__suppress_context__ = True
    while cause is not None:  # the native error, and what it was raised from: no retries shown
        cause.__suppress_context__ = True
        cause = cause.__cause__


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames that `exc` and its causes passed through.

    A failed transfer's exception holds its frames, and they hold it back in cycles (a
    task's exception -> its traceback -> the frame holding the task or the request), with
    the RDTObject in them: the object, and with it the producer's tensors, would live
    until the consumer's garbage collector runs. Lines and messages stay; frames still
    running (the caller's) are left alone.
    """
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
        todo += getattr(e, "exceptions", ())  # an ExceptionGroup's members


def unavailable(name: str, why: str) -> TransportUnavailableError:
    return TransportUnavailableError(f"transport {name!r} cannot serve this fetch: {why}")


def few(items: Sequence[str], limit: int = 8) -> str:
    """`items` joined for a message, at most `limit` of them: a state dict of 10,000 tensors
    must not make a message of 10,000 names."""
    if len(items) <= limit:
        return ", ".join(items)
    return f"{', '.join(items[:limit])}, ... ({len(items)} in all)"
