"""The error tree of rdt_async, and the one place native errors are translated."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class RDTError(Exception):
    """Base class of every error rdt_async raises."""

    def __init__(self, message: str, *, obj_id: str | None = None) -> None:
        super().__init__(message)
        self.obj_id = obj_id

    def __reduce__(self):  # keep obj_id across Ray's pickling of task errors
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


def translate(exc: BaseException, what: str, obj_id: str | None = None, *, user_code: bool = False) -> BaseException:
    """Map a native error raised while doing `what` to the rdt_async tree.

    The result is meant for ``raise translate(exc, ...) from exc``. Errors that are
    already ours, cancellation and timeouts pass through unchanged; with `user_code`
    (resolving a method's ref), so does what the method raised, as `ray.get` raises it
    (a `RayTaskError` that is also an instance of the method's exception class).
    """
    if isinstance(exc, (RDTError, TimeoutError, KeyboardInterrupt, SystemExit)):
        return exc
    if type(exc).__name__ == "CancelledError":
        return exc
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is not None:
        cause = getattr(exc, "cause", None)
        if isinstance(exc, ray_exceptions.RayTaskError) and isinstance(cause, RDTError):
            # Rebuild the remote error so that ``except ObjectFreedError`` works here.
            return type(cause)(str(cause), obj_id=cause.obj_id)
        if isinstance(exc, ray_exceptions.RayTaskError) and user_code:
            return exc
        if isinstance(exc, (ray_exceptions.RayActorError, ray_exceptions.ActorDiedError)):
            return PeerDiedError(f"{what}: the producer died ({exc})", obj_id=obj_id)
        if isinstance(exc, ray_exceptions.GetTimeoutError):
            return TimeoutError(f"{what}: timed out")
        if isinstance(exc, ray_exceptions.ObjectLostError):
            return ObjectFreedError(f"{what}: the object was lost ({exc})", obj_id=obj_id)
        if isinstance(exc, ray_exceptions.RayError):
            return BackendError(f"{what} failed in Ray: {exc}", obj_id=obj_id)
    native = type(exc).__name__
    if native == "nixlRemoteDisconnectError" or native.startswith("UCXConnectionReset"):
        return PeerDiedError(f"{what}: the producer disconnected ({native}: {exc})", obj_id=obj_id)
    if native.startswith("nixl") or native.startswith("UCX"):
        lib = "NIXL" if native.startswith("nixl") else "UCX"
        return BackendError(f"{what} failed in {lib}: {native}: {exc}", obj_id=obj_id)
    if isinstance(exc, FileNotFoundError):
        return ObjectFreedError(f"{what}: the object was freed (or its producer died)", obj_id=obj_id)
    return BackendError(f"{what} failed: {type(exc).__name__}: {exc}", obj_id=obj_id)


@contextmanager
def translating(what: str, obj_id: str | None = None, *, user_code: bool = False) -> Iterator[None]:
    """Translate native errors raised in the block (see `translate`), keeping the chain."""
    try:
        yield
    except BaseException as exc:
        err = translate(exc, what, obj_id, user_code=user_code)
        if err is exc:
            raise
        raise err from exc


def unavailable(name: str, why: str) -> TransportUnavailableError:
    return TransportUnavailableError(f"transport {name!r} cannot serve this fetch: {why}")
