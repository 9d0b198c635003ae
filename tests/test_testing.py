"""rdt_async.testing without Ray: MockTransport and roundtrip drive real transports in one process."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import rdt_async as rdt
from rdt_async.testing import LoopbackChannel, MockTransport, roundtrip
from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo
from rdt_async.transports.shm import ShmTransport

REPO = Path(__file__).resolve().parents[1]


def _values():
    return [torch.arange(12, dtype=torch.float32).view(3, 4), torch.tensor([1, 2, 3], dtype=torch.int64), torch.empty(0)]


def _same(got, want):
    assert [(t.shape, t.dtype, t.device.type) for t in got] == [(t.shape, t.dtype, t.device.type) for t in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


async def test_mock_transport_returns_a_snapshot_taken_at_return():
    values = _values()
    transport = MockTransport()
    meta = transport.prepare("o1", values)
    values[0].fill_(-1)  # after return: the fetch sees the value as it was returned
    info = TransferInfo("o1", tuple(TensorSpec.of(t) for t in values), meta)
    got = await FetchRequest.start(transport, info).wait()
    assert got[0].sum().item() == sum(range(12)) and torch.equal(got[1], torch.tensor([1, 2, 3]))


async def test_mock_transport_writes_into_the_callers_buffers():
    values = _values()
    into = [torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64), torch.empty(0)]
    got = await roundtrip(MockTransport(), values, buffers=into)
    assert all(g is b for g, b in zip(got, into))
    _same(into, values)


class _Slow(MockTransport):
    async def handle(self, info, tensors):
        await asyncio.sleep(30)
        return tensors


class _Lost(MockTransport):
    async def handle(self, info, tensors):
        raise rdt.PeerDiedError(f"the producer of {info.obj_id} went away", obj_id=info.obj_id)


async def test_a_mock_subclass_makes_fetches_slow_or_fail():
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await roundtrip(_Slow(), _values())
    with pytest.raises(rdt.PeerDiedError, match="the producer of roundtrip-0 went away"):
        await roundtrip(_Lost(), _values())


async def test_roundtrip_drives_shared_memory_in_one_process():
    values = [torch.randn(1 << 16), torch.arange(7)]
    transport = ShmTransport()
    got = await roundtrip(transport, values, obj_id="shm-roundtrip")
    _same(got, values)


async def test_roundtrip_drives_the_docs_example_transport(tmp_path):
    example = sys.modules.get("custom_transport")  # (as test_custom_transport loads it: one "spool")
    if example is None:
        spec = importlib.util.spec_from_file_location("custom_transport", REPO / "examples" / "custom_transport.py")
        example = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = example
        spec.loader.exec_module(example)
    transport = example.SpoolTransport()
    transport.root = str(tmp_path)
    values = _values()
    _same(await roundtrip(transport, values), values)
    assert not list(tmp_path.rglob("*.pt"))  # recycled: the spool file is gone


class _Echo(rdt.Transport[None]):
    """Two-sided: the producer's reply carries the tensors (as tests/ep_pkg's EchoTransport)."""

    one_sided = False

    async def send_multiple_tensors(self, obj_id, tensors, meta, request):
        assert request == {"want": obj_id}
        return [t.clone() for t in tensors]

    async def receive(self, info, buffers, channel):
        return await channel.request_send({"want": info.obj_id})


async def test_roundtrip_asks_a_two_sided_transport_through_a_loopback_channel():
    values = _values()
    _same(await roundtrip(_Echo(), values, obj_id="echo-1"), values)
    channel = LoopbackChannel(_Echo(), "gone-1", values, None)
    channel.gone = True  # the object was freed: the producer refuses
    assert await channel.request_send({"want": "gone-1"}) is None and channel.requests == [{"want": "gone-1"}]


async def test_roundtrip_refuses_what_the_transport_cannot_move():
    with pytest.raises(rdt.TransportUnavailableError, match=r"moves dense tensors.*to_dense\(\)"):
        await roundtrip(MockTransport(), [torch.eye(2).to_sparse()])
