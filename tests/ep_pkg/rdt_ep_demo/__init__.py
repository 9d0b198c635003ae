"""A third-party transport, shipped through the `rdt_async.transports` entry point group.

`tests/test_custom_transport.py` copies this folder (the package and its dist-info) to a
temporary site directory and puts that on the path: that is all an install does for
entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import rdt_async as rdt


class EchoTransport(rdt.Transport[None]):
    """Two-sided: the producer's reply to the consumer's request carries copies of the tensors."""

    devices = ("cpu",)
    one_sided = False

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: None, request: Any
    ) -> list[torch.Tensor]:
        return [t.detach().clone() for t in tensors]

    async def receive(
        self, info: rdt.TransferInfo[None], buffers: list[torch.Tensor] | None, channel: Any
    ) -> list[torch.Tensor]:
        tensors = await channel.request_send(None)
        if buffers is None:
            return tensors
        return [b.copy_(t) for b, t in zip(buffers, tensors)]
