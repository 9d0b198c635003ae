"""One transfer of a fetch: over the transport chosen, watched for its producer's death,
and where `auto` chose a path that cannot be used with this producer, over the next
candidate (`_choose`), at the last the object store.

Runs on: consumer, the I/O loop (`_fetch.fetch_object`, directly or as the node relay's
read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import _buffers, _ray
from ._avoid import avoided, unusable
from ._choose import address_of, choose_transport
from ._errors import ObjectFreedError, RDTError, TransferError, TransportUnavailableError, translating
from ._object import RDTObject
from .transports import _registry
from .transports._base import FetchRequest, TransferInfo, Transport


def info_for(obj: RDTObject, meta: Any) -> TransferInfo[Any]:
    """What a transport is told of `obj` to fetch it with `meta`."""
    return TransferInfo(obj.obj_id, obj.specs, meta, hold=obj, producer_pid=obj.producer.pid, producer_node=obj.producer.node_id)


async def fetch_over(
    obj: RDTObject,
    transport: Transport[Any],
    info: TransferInfo[Any],
    buffers: list[torch.Tensor] | None = None,
    used: list[str] | None = None,
    asked: str | None = None,
    landed: Callable[[int, int, int], None] | None = None,
    writes: _buffers.Writes | None = None,
) -> tuple[list[torch.Tensor], str]:
    """`_transfer`, and where `auto` chose a path that cannot be used with this producer,
    the next candidate, and at the last the object store. Return the tensors and the path
    (also put in `used[0]`, where given). `landed`: told of each range of `buffers` as it
    lands, where the transport says so (`Transport.reports_landed`; a fallback's transport
    may not). `writes`: the claim on the caller's `buffers` (`_transfer`).

    The one fallback of a fetch: the reason goes into `store_stats()["auto"]`, is logged
    once per node and path, and `auto` leaves a path that could not reach a node out of
    that node's fetches for `_avoid.AVOID_S`; where the next path fails too, its error
    says why each path before it could not be used. A transport named explicitly, by the
    producer or by the consumer (`asked`), fails instead.
    """
    chosen = asked or obj.transport
    fell_back: list[tuple[str, str]] = []
    if landed is not None and buffers is not None and transport.reports_landed:
        info = dataclasses.replace(info, landed=landed)
    while True:
        try:
            tensors = await _transfer(obj, transport, info, buffers, writes)
        except (TransportUnavailableError, TransferError) as exc:
            why = unusable(exc) if chosen == _registry.AUTO else None
            if why is not None and transport.name != _registry.FALLBACK:
                avoided.note(obj.producer, transport.name, exc, why, address_of(type(transport), info.meta))
                without = frozenset(t for t, _ in fell_back) | {transport.name}
                auto = obj if obj.transport == _registry.AUTO else dataclasses.replace(obj, transport=_registry.AUTO)
                name, meta = choose_transport(auto, _ray.node_id(), without=without, fell_back=(*fell_back, (transport.name, why)))
                if name not in without:
                    fell_back.append((transport.name, why))
                    transport = _registry.transport(name)
                    info = info_for(obj, meta)
                    del exc
                    continue
            told = _after(exc, transport.name, fell_back)  # (no next path: this error, with why the others failed)
            if told is not exc:
                raise told from exc
            raise
        if used is not None:
            used[0] = transport.name
        return tensors, transport.name


def tensors_of(fetch: Any) -> Any:
    """`fetch_over` (a partial of it) as the relay calls a transfer: the tensors alone."""
    if fetch is None:
        return None

    async def tensors(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return (await fetch(*args, **kwargs))[0]  # type: ignore[no-any-return]

    return tensors


def _after(exc: RDTError, name: str, fell_back: list[tuple[str, str]]) -> RDTError:
    """`exc`, raised by `name` where `auto` fell back to it, saying why each path before it
    could not be used: the first one's reason names the address and the setting to change,
    which the last path's error (the object store of a driver's put, say) does not. `exc`
    itself where `auto` fell back to no path before it."""
    if not fell_back:
        return exc
    tried = "; ".join(f"{path}: {why[:1000]}" for path, why in fell_back)
    try:  # (a new error: the one raised may be another fetch's too)
        return type(exc)(f"{exc} (auto took {name} after: {tried})", obj_id=exc.obj_id)
    except Exception:  # a transport's own error type that is not built so: as it is
        return exc


async def _transfer(
    obj: RDTObject,
    transport: Transport[Any],
    info: TransferInfo[Any],
    buffers: list[torch.Tensor] | None,
    writes: _buffers.Writes | None = None,
) -> list[torch.Tensor]:
    """Move the object's bytes over `transport` (into `buffers` when given, whose claim
    `writes` is kept until the transfer has let go of them)."""
    name = transport.name
    request = FetchRequest.start(transport, info, buffers=buffers, channel=_ray.RayChannel(obj, name))
    try:
        with translating(f"{name} fetch of {obj.obj_id}", obj.obj_id, transport=transport):
            return await _ray.watched(request.wait(), obj, name)
    except (TransferError, ObjectFreedError) as exc:
        await _ray.raise_if_died(obj, name, exc)
        raise
    finally:
        if writes is not None and not request.settled.done():  # given up on (`_io.SETTLE_S`): it may write yet
            writes.release_after(request.settled)
