"""`into=` buffers a transfer cannot write are refused at the call, naming the fix, over every
transport; the others (inference tensors, parameters, strided, empty) receive the right values.

A refused fetch sends nothing: over Gloo the very next fetch on the same group works at once
(a half-started transfer used to leave the producer's send or the consumer's receive hanging
30 s and the group broken), and the consumer process lives (a read-only buffer killed it).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import tempfile
import time
import warnings

import numpy as np
import pytest
import ray
import torch

import rdt_async as rdt
from rdt_async.transports._base import TensorSpec
from rdt_async.transports._kit import landing_buffers

pytestmark = pytest.mark.usefixtures("ray_session")

N = 1 << 16  # 256 KiB of float32: over Ray's inline limit (a ray.get value is then in its store)
TRANSPORTS = ["shm", "tcp", "object_store", "nixl", "gloo"]


def expected(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n) % 251 + 1).to(dtype) * (1 + 1j if dtype.is_complex else 1)


# kind -> (dtype of the object, what the refusal says). Built in the consumer (`make`).
REFUSED = {
    "read-only mmap": (torch.float32, ["into= tensor 0 lies in read-only memory", "PROT_READ", "torch.empty((65536,), dtype=torch.float32)"]),
    "np.memmap mode r": (torch.float32, ["into= tensor 0 lies in read-only memory", "np.memmap"]),
    "ray.get value": (torch.float32, ["into= tensor 0 lies in Ray's object store", "immutable", ".clone()"]),
    "meta": (torch.float32, ["into= tensor 0 is on the meta device, which holds no memory", "torch.empty((65536,)"]),
    "fake": (torch.float32, ["into= tensor 0 is a FakeTensor without memory of its own", "torch.empty((65536,)"]),
    "sparse": (torch.float32, ["into= tensor 0 is a sparse_coo tensor, not a dense (strided) one", "torch.empty("]),
    "nested": (torch.float32, ["into= tensor 0 is a nested tensor", "torch.empty("]),
    "quantized": (torch.float32, ["into= tensor 0 is quantized (torch.quint8)", "scale and zero point"]),
    "lazy conjugate": (torch.complex64, ["into= tensor 0 is a lazy conjugate", "dtype=torch.complex64", "take the view after"]),
    "lazy negation": (torch.float32, ["into= tensor 0 is a lazy negation", "take the view after"]),
    "shrunk storage": (torch.float32, ["into= tensor 0 reaches 262144 bytes into a storage of 64", "resize_()"]),
    "expanded": (torch.float32, ["into= tensor 0 has elements that share memory", "torch.empty_like"]),
}

# kind -> dtype of the object; each receives the object's exact value.
HANDLED = {
    "inference": torch.float32,
    "parameter": torch.float32,
    "view of a parameter": torch.float32,
    "strided": torch.float32,
    "zero-size": torch.float32,
    "writable mmap": torch.float32,
    "read-only numpy over bytes": torch.float32,
}


def make(kind: str, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
    """A buffer of `kind` for n elements of `dtype`, and what must outlive it (and is read back)."""
    nbytes = n * dtype.itemsize
    if kind in ("read-only mmap", "np.memmap mode r", "writable mmap"):
        fd, path = tempfile.mkstemp()
        os.write(fd, bytes(nbytes))
        os.unlink(path)
        if kind == "np.memmap mode r":
            arr = np.memmap(f"/proc/self/fd/{fd}", dtype=np.float32, mode="r", shape=(n,))
            os.close(fd)
            return torch.from_numpy(arr), arr
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if kind == "writable mmap" else 0)
        mm = mmap.mmap(fd, nbytes, prot=prot)
        os.close(fd)
        return torch.frombuffer(mm, dtype=dtype), mm
    if kind == "ray.get value":
        arr = ray.get(ray.put(np.zeros(n, dtype=np.float32)))  # zero-copy, read-only, in Ray's store
        return torch.from_numpy(arr), arr
    if kind == "read-only numpy over bytes":
        arr = np.frombuffer(bytes(nbytes), dtype=np.float32)
        return torch.from_numpy(arr), arr
    if kind == "meta":
        return torch.empty(n, dtype=dtype, device="meta"), None
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.empty(n, dtype=dtype), None
    if kind == "sparse":
        return torch.zeros(n, dtype=dtype).to_sparse(), None
    if kind == "nested":
        return torch.nested.nested_tensor([torch.zeros(n // 2), torch.zeros(n // 2 + 1)]), None
    if kind == "quantized":
        return torch.quantize_per_tensor(torch.zeros(n), 0.5, 0, torch.quint8), None
    if kind == "lazy conjugate":
        return torch.zeros(n, dtype=torch.complex64).conj(), None
    if kind == "lazy negation":
        return torch.zeros(n, dtype=torch.complex64).conj().imag, None
    if kind == "shrunk storage":
        t = torch.zeros(n, dtype=dtype)
        t.untyped_storage().resize_(64)  # a write through t would run 256 KiB past its storage
        return t, None
    if kind == "expanded":
        return torch.zeros(1, dtype=dtype).expand(n), None
    if kind == "inference":
        with torch.inference_mode():
            return torch.zeros(n, dtype=dtype), None
    if kind == "parameter":
        return torch.nn.Parameter(torch.zeros(n, dtype=dtype)), None
    if kind == "view of a parameter":
        p = torch.nn.Parameter(torch.zeros(2 * n, dtype=dtype))
        return p[n:], p  # not a leaf: a view with a grad_fn
    if kind == "strided":
        return torch.zeros(2 * n, dtype=dtype)[::2], None
    if kind == "zero-size":
        return torch.zeros(0, dtype=dtype), None
    raise AssertionError(kind)


@rdt.remote
class Producer:
    def put(self, transport: str, n: int, dtype: torch.dtype) -> list:
        return [rdt.put(expected(n, dtype), tensor_transport=transport)]

    def filled(self, transport: str, n: int, value: float) -> list:
        return [rdt.put(torch.full((n,), value), tensor_transport=transport)]


@rdt.remote
class Consumer:
    async def refuse(self, refs: list, kind: str) -> dict:
        """Fetch into a bad buffer: what was raised, how fast, whether it was written; then a good fetch."""
        warnings.simplefilter("ignore")  # torch warns of non-writable numpy/buffers at from_numpy
        obj = await refs[0]
        spec = obj.specs[0]
        buf, keep = make(kind, spec.shape[0], spec.dtype)
        began = time.monotonic()
        try:
            async with asyncio.timeout(10):
                await rdt.fetch(obj, into=buf)
            raised = ("nothing", "")
        except Exception as e:
            raised = (type(e).__name__, str(e))
        took = time.monotonic() - began
        untouched = None
        if isinstance(keep, mmap.mmap):
            untouched = keep[:] == bytes(len(keep))
        elif isinstance(keep, np.ndarray):
            untouched = not keep.any()
        began = time.monotonic()
        async with asyncio.timeout(10):
            good = await rdt.fetch(obj, into=torch.empty(spec.shape, dtype=spec.dtype))
        return {
            "raised": raised,
            "took": took,
            "untouched": untouched,
            "next": torch.equal(good, expected(spec.shape[0], spec.dtype)),
            "next_took": time.monotonic() - began,
        }

    async def two_into_one(self, slow: list, fast: list) -> dict:
        """Fetch `slow`, then (at once) `fast`, into one buffer: in which order they ended, and what it holds."""
        a, b = await slow[0], await fast[0]
        buf = torch.zeros(a.specs[0].shape)
        ended = []

        async def fetch(obj, name):
            await rdt.fetch(obj, into=buf)
            ended.append(name)

        async with asyncio.timeout(60):
            first = asyncio.ensure_future(fetch(a, "slow"))
            await asyncio.sleep(0)  # (its transfer started)
            await asyncio.gather(first, fetch(b, "fast"))
        return {"ended": ended, "holds": buf.unique().tolist()}

    async def into_what_it_keeps(self, refs: list, transport: str) -> dict:
        """Fetch into a tensor this process returned and still keeps for its consumers: refused
        until that object is freed; then received."""
        obj = await refs[0]
        w = torch.zeros(obj.specs[0].shape)
        kept = await rdt.put({"w": w[1:]}, tensor_transport=transport)  # a view of it: its bytes are held
        out: dict = {}
        for name, into in (("the tensor", w), ("a list of it", [w])):
            try:
                async with asyncio.timeout(10):
                    await rdt.fetch(obj, into=into)
                out[name] = "nothing"
            except ValueError as exc:
                out[name] = str(exc)
        out["untouched"] = not w.any()
        rdt.free(kept)
        async with asyncio.timeout(10):
            await rdt.wait_tensor_freed(w)
            await rdt.fetch(obj, into=w)
        out["after the free"] = torch.equal(w, expected(w.shape[0], w.dtype))
        return {**out, "kept": kept.obj_id}

    async def handle(self, refs: list, kind: str) -> dict:
        """Fetch into a buffer that must receive: is the value in it, and is the result the buffer's memory?"""
        warnings.simplefilter("ignore")
        obj = await refs[0]
        spec = obj.specs[0]
        buf, keep = make(kind, spec.shape[0], spec.dtype)
        async with asyncio.timeout(20):
            got = await rdt.fetch(obj, into=buf)
        want = expected(spec.shape[0], spec.dtype)
        return {
            "in buffer": torch.equal(buf.detach(), want),
            "returned": torch.equal(got.detach(), want),
            "same memory": got.data_ptr() == buf.data_ptr(),
            "grad kept": buf.requires_grad if kind in ("parameter", "view of a parameter") else None,
            "written by": type(keep).__name__ if keep is not None else None,
        }


@pytest.fixture(scope="module")
def actors():
    """A producer and a consumer, in one Gloo group."""
    p, c = Producer.remote(), Consumer.remote()
    group = rdt.create_collective_group([p, c], backend="gloo")
    yield p, c
    rdt.destroy_collective_group(group)
    ray.kill(p)
    ray.kill(c)


def _skip_unavailable(transport: str) -> None:
    why = rdt.available_transports().get(transport)
    if why is not True:
        pytest.skip(f"{transport}: {why}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buffers_no_transfer_can_write_are_refused_at_the_call(actors, transport):
    _skip_unavailable(transport)
    p, c = actors
    wrong = {}
    for kind, (dtype, says) in REFUSED.items():
        try:
            out = ray.get(c.refuse.remote(p.put.remote(transport, N, dtype), kind), timeout=60)
        except Exception as e:  # the consumer died, or the next fetch failed
            wrong[kind] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        name, message = out["raised"]
        if not (
            name == "ValueError"
            and all(part in message for part in says)
            and out["took"] < 1.0  # refused before anything moved, not after a wait
            and out["untouched"] in (None, True)
            and out["next"]  # the same object again, over the same group
            and out["next_took"] < 5.0
        ):
            wrong[kind] = out
    assert not wrong, wrong


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buffers_a_transfer_can_write_receive_the_value(actors, transport):
    _skip_unavailable(transport)
    p, c = actors
    wrong = {}
    for kind, dtype in HANDLED.items():
        n = 0 if kind == "zero-size" else N
        try:
            out = ray.get(c.handle.remote(p.put.remote(transport, n, dtype), kind), timeout=60)
        except Exception as e:
            wrong[kind] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if not (out["in buffer"] and out["returned"] and (out["same memory"] or n == 0) and out["grad kept"] in (None, True)):
            wrong[kind] = out
    assert not wrong, wrong


def test_a_refused_buffer_leaves_the_gloo_group_working_for_the_next_fetch(actors):
    """The finding: a meta buffer over Gloo waited 30 s, failed, and broke the group for good."""
    p, c = actors
    for kind in ("meta", "read-only mmap"):
        out = ray.get(c.refuse.remote(p.put.remote("gloo", N, torch.float32), kind), timeout=60)
        assert out["raised"][0] == "ValueError" and out["took"] < 1.0, (kind, out)
        assert out["next"] and out["next_took"] < 5.0, (kind, out)


async def test_a_same_process_object_into_buffers_that_alias_its_tensors():
    """A process that fetches what it produced copies from the object's tensors: into the very
    same tensors changes nothing; into one that overlaps another tensor of it is refused."""
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    ref = rdt.put([a, b])
    async with asyncio.timeout(10):
        got = await rdt.fetch(ref, into=[a, b])  # its own tensors: a copy onto itself
    assert got[0] is a and a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [10.0, 11.0, 12.0, 13.0]
    with pytest.raises(ValueError, match=r"into= tensor 0 shares memory with tensor 1 of the object it receives"):
        async with asyncio.timeout(10):
            await rdt.fetch(ref, into=[b, a])  # swapped: the first copy would overwrite the second's source
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [10.0, 11.0, 12.0, 13.0]  # nothing written
    wide = torch.arange(8.0)
    held = [wide[:4], torch.zeros(4)]  # alive: a fetch here gets these very tensors
    ref2 = rdt.put(held)
    with pytest.raises(ValueError, match="into= tensor 1 shares memory with tensor 0"):
        async with asyncio.timeout(10):
            await rdt.fetch(ref2, into=[torch.empty(4), wide[2:6]])
    assert wide.tolist() == list(map(float, range(8)))
    rdt.free(await ref)
    rdt.free(await ref2)


def test_a_buffer_on_another_device_is_not_handed_to_the_native_receive():
    """Gloo, NCCL, tcp and ucxx receive into a caller's buffer only on their own device: a
    CUDA buffer under Gloo (or a CPU one under NCCL) lands where the library can write,
    and is copied over after."""
    spec = TensorSpec((4,), torch.float32, "cpu", 16)
    mine, elsewhere = torch.empty(4), torch.empty(4, device="meta")
    landed = landing_buffers([spec, spec], [mine, elsewhere], "cpu")
    assert landed[0] is mine
    assert landed[1] is not elsewhere and landed[1].device.type == "cpu" and landed[1].shape == (4,)


def test_an_iterator_of_buffers_is_refused_naming_a_list():
    """`into=model.parameters()` (a generator) was refused as "holds no tensor"."""
    from rdt_async import _buffers
    from rdt_async.transports._base import TensorSpec

    model = torch.nn.Linear(4, 2)
    specs = tuple(TensorSpec.of(p.detach()) for p in model.parameters())
    with pytest.raises(TypeError, match=r"into= is an iterator \(generator\).*into=list\(model.parameters\(\)\)"):
        _buffers.checked(specs, model.parameters())
    got = _buffers.checked(specs, list(model.parameters()))
    assert got is not None and [tuple(t.shape) for t in got] == [(2, 4), (2,)]


def test_a_second_fetch_into_a_buffer_waits_for_the_first_instead_of_mixing_the_two(actors):
    # Without waiting, the fast (shm) fetch wrote the buffer while the slow one (the object
    # store) was under way, and the slow one's bytes landed over it after it returned.
    p, c = actors
    n = 4 << 20  # 16 MiB of float32
    slow, fast = ray.get([p.filled.remote("object_store", n, 1.0), p.filled.remote("shm", n, 2.0)])
    got = ray.get(c.two_into_one.remote(slow, fast), timeout=120)
    del slow, fast
    assert got == {"ended": ["slow", "fast"], "holds": [2.0]}, got


@pytest.mark.parametrize("kept_over", ["shm", "tcp", "object_store"])
def test_a_buffer_that_this_process_returned_and_still_keeps_is_refused_until_freed(actors, kept_over):
    # Written, the consumers of the kept object (or its later fetches) would read the new
    # bytes, or a mix of both: a stale or torn value, silently.
    p, c = actors
    out = ray.get(c.into_what_it_keeps.remote(p.put.remote("shm", N, torch.float32), kept_over), timeout=60)
    for name in ("the tensor", "a list of it"):
        assert out[name] == (
            f"into= tensor 0 shares memory with object {out['kept']}, which this process produced and keeps for "
            "its consumers: a write now would change what they read, or tear a read under way. Write it once they "
            "are done (`await rdt.wait_tensor_freed(t)`, or free the object: `rdt.free(ref)`), or receive into a "
            "buffer of its own"
        ), out
    assert out["untouched"] and out["after the free"], out
