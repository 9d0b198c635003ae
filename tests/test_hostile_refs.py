"""A ref's metadata is input: a consumer refuses what its producer did not make.

Each test crafts one field of a real RDTObject (`dataclasses.replace` on what a real
producer returned) and hands it to a consumer actor, which fetches it. The fetch must
raise the right error with a message naming what was refused, read nothing (a file of
known secret content never shows up), hang on nothing, and leave no descriptor behind;
the consumer then still fetches honest refs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import uuid

import pytest
import ray
import torch

import rdt_async as rdt
from rdt_async.transports import _segments, shm
from rdt_async.transports._base import TensorSpec

SECRET = 1234.5  # the value every element of a file the consumer must never read holds
N = 1000  # float32 elements of an ordinary object: copied into a segment
BIG = shm.SHARE_MIN_BYTES // 4  # float32 elements of a shared storage

pytestmark = pytest.mark.usefixtures("ray_session")


@rdt.remote
class Producer:
    def __init__(self) -> None:
        self.w = torch.full((BIG,), 3.0).share_memory_()  # exported without a copy
        self.hidden = torch.full((BIG,), SECRET).share_memory_()  # never returned

    @rdt.method(tensor_transport="shm")
    def make(self, v: float):
        return {"x": torch.full((N,), v)}

    @rdt.method(tensor_transport="shm")
    def weights(self):
        return {"w": self.w}

    def hidden_storage(self) -> dict:
        """Where the storage it never returned lies: what a forger could learn from /proc."""
        fd = self.hidden.untyped_storage()._get_shared_fd()
        st = os.fstat(fd)
        return {"pid": os.getpid(), "fd": fd, "inode": (st.st_dev, st.st_ino), "nbytes": self.hidden.nbytes}


@rdt.remote
class Consumer:
    async def attempt(self, objs) -> dict:
        """Fetch objs[0]; say what happened and which descriptors it left open."""
        import gc

        from rdt_async.transports import _mappings

        gc.collect()
        _mappings.cache.clear()  # mappings kept for the next fetch hold a descriptor each
        before = set(os.listdir("/proc/self/fd"))
        out: dict = {}
        try:
            async with asyncio.timeout(20):
                value = await rdt.fetch(objs[0])
            out["sums"] = [float(t.double().sum()) for t in value.values()]
            del value
        except TimeoutError:
            out["error"] = "hung"
        except Exception as exc:
            out["error"], out["message"] = type(exc).__name__, str(exc)
        gc.collect()
        _mappings.cache.clear()
        new = set(os.listdir("/proc/self/fd")) - before
        out["new_fds"] = sorted(_target(fd) for fd in new)
        return out


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "(closed)"


def _files(targets: list[str]) -> list[str]:
    """The descriptors that name files (a fetch's leak), not Ray's sockets and pipes."""
    return [t for t in targets if t.startswith("/")]


@pytest.fixture(scope="module")
def actors():
    p, other, c = Producer.remote(), Producer.remote(), Consumer.remote()
    # A first honest fetch: what a consumer opens once per process (the /dev/shm dir fd,
    # the I/O loop) is open before the descriptors are counted.
    got = ray.get(c.attempt.remote([ray.get(p.make.remote(1.0))]))
    assert got["sums"] == [float(N)], got
    got = ray.get(c.attempt.remote([ray.get(p.weights.remote())]))
    assert got["sums"] == [3.0 * BIG], got
    yield p, other, c
    for a in (p, other, c):
        ray.kill(a)


@pytest.fixture
def made(ray_session):
    """Keep what the test has a producer make; free it after the test, before the leak check.

    Freed, a segment is unlinked at once; dropped, it would stay warm in its producer's pool
    for RDT_SHM_IDLE_S, and the leak check would wait that long for it (a leaked one still fails it).
    """
    objs: list = []
    yield objs
    for obj in objs:
        rdt.free(obj)


def _get(made: list, ref):
    obj = ray.get(ref)
    made.append(obj)
    return obj


def _crafted(obj, **fields):
    return dataclasses.replace(obj, meta={**obj.meta, "shm": dataclasses.replace(obj.meta["shm"], **fields)})


def _refused(consumer, crafted, error: str, *words: str) -> dict:
    got = ray.get(consumer.attempt.remote([crafted]))
    assert got.get("error") == error, got
    for w in words:
        assert w in got["message"], got
    assert "sums" not in got and str(SECRET) not in got["message"]
    assert _files(got["new_fds"]) == [], got  # nothing left open
    return got


def _still_serves(p, consumer) -> None:
    obj = ray.get(p.make.remote(2.0))
    got = ray.get(consumer.attempt.remote([obj]))
    rdt.free(obj)  # its segment goes now (see `made`)
    assert got["sums"] == [2.0 * N] and _files(got["new_fds"]) == [], got


@pytest.mark.parametrize("segment", ["../../etc/passwd", "/etc/passwd", "rdt-1-2-../../../etc/passwd", "", None])
def test_a_segment_name_that_is_a_path_is_refused_before_any_open(actors, made, segment):
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    if segment is None:  # no segment, while a tensor lies in one
        _refused(c, _crafted(obj, segment=None), "TransferError", "refused metadata", "no segment")
    else:
        _refused(c, _crafted(obj, segment=segment), "TransferError", "refused metadata", "is not a name of ours")
    _still_serves(p, c)


def _secret_file(path: str) -> None:
    with open(path, "wb") as f:
        f.write(torch.full((1 << 18,), SECRET).numpy().tobytes())


def _named_like_its_segment(obj) -> tuple[str, str]:
    """A name (and key) that passes the name check for `obj`: a forger chose the key."""
    m = _segments.SEGMENT_NAME.fullmatch(obj.meta["shm"].segment)
    assert m is not None
    key = _segments.new_key()
    meta = obj.meta["shm"]
    layout = [(off, s.nbytes) for s, off in zip(obj.specs, meta.offsets) if s.nbytes]
    return _segments.name_for(obj.obj_id, key, meta.size, layout, int(m[1]), m[2]), key


def test_a_symlink_in_dev_shm_named_like_a_segment_is_never_followed(actors, made, tmp_path):
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    secret = str(tmp_path / "secret")
    _secret_file(secret)
    name, key = _named_like_its_segment(obj)
    link = os.path.join(shm.SHM_DIR, name)
    os.symlink(secret, link)
    try:
        _refused(c, _crafted(obj, segment=name, key=key), "TransferError", f"refused {shm.SHM_DIR}/{name}")
    finally:
        os.unlink(link)
    _still_serves(p, c)


def test_a_fifo_named_like_a_segment_is_refused_without_waiting(actors, made):
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    name, key = _named_like_its_segment(obj)
    fifo = os.path.join(shm.SHM_DIR, name)
    os.mkfifo(fifo, 0o600)
    try:
        _refused(c, _crafted(obj, segment=name, key=key), "TransferError", "not a regular file")
    finally:
        os.unlink(fifo)


def test_a_hard_link_to_a_file_named_like_a_segment_is_refused(actors, made):
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    name, key = _named_like_its_segment(obj)
    secret = os.path.join(shm.SHM_DIR, f"test-secret-{uuid.uuid4().hex}")
    _secret_file(secret)
    os.link(secret, os.path.join(shm.SHM_DIR, name))
    try:
        _refused(c, _crafted(obj, segment=name, key=key), "TransferError", "has 2 name(s)")
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, name))
        os.unlink(secret)


def test_another_producers_segment_is_refused(actors, made):
    p, other, c = actors
    mine, theirs = _get(made, p.make.remote(1.0)), _get(made, other.make.remote(SECRET))
    _refused(c, _crafted(mine, segment=theirs.meta["shm"].segment), "TransferError", "not by the producer")
    # Its whole metadata: the name is still another process's.
    forged = dataclasses.replace(mine, meta={**mine.meta, "shm": theirs.meta["shm"]})
    _refused(c, forged, "TransferError", "not by the producer")
    _still_serves(p, c)


def test_another_objects_segment_of_the_same_producer_is_refused(actors, made):
    p, _, c = actors
    mine, theirs = _get(made, p.make.remote(1.0)), _get(made, p.make.remote(SECRET))
    _refused(c, _crafted(mine, segment=theirs.meta["shm"].segment), "TransferError", "not the one its producer makes")
    # Its segment and key together: the name is bound to the object's id as well.
    forged = dataclasses.replace(mine, meta={**mine.meta, "shm": theirs.meta["shm"]})
    _refused(c, forged, "TransferError", f"not the one its producer makes for object {mine.obj_id}")
    _refused(c, _crafted(mine, key="0" * 32), "TransferError", "not the one its producer makes")
    _refused(c, _crafted(mine, key=None), "TransferError", "key is missing or malformed")
    assert ray.get(c.attempt.remote([theirs]))["sums"] == [SECRET * N]  # its own ref reads it


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"offsets": (1 << 20,)}, "tensor 0 at offset 1048576"),  # past the segment
        ({"offsets": (-64,)}, "tensor 0 at offset -64"),
        ({"offsets": (3,)}, "tensor 0 at offset 3"),  # unaligned
        ({"offsets": (0, 64)}, "do not match its 1 tensor(s)"),
        ({"offsets": ("0",)}, "tensor 0 at offset '0'"),
        ({"size": 1 << 30, "offsets": ((1 << 30) - 4096,)}, "not the one its producer makes for object"),
        # The segment's whole capacity (a reused segment's tail holds an earlier object's bytes):
        ({"size": _segments.MIN_BYTES, "offsets": (_segments.MIN_BYTES // 2,)}, f"of {_segments.MIN_BYTES} bytes"),
        ({"size": -1}, "size -1"),
        ({"shared": (None, None)}, "do not match its 1 tensor(s)"),
    ],
)
def test_sizes_and_offsets_beyond_the_segment_are_refused(actors, made, fields, words):
    p, _, c = actors
    _refused(c, _crafted(_get(made, p.make.remote(1.0)), **fields), "TransferError", words)


def test_a_shared_storage_in_another_process_is_refused(actors, made):
    p, other, c = actors
    obj = _get(made, p.weights.remote())
    sh = obj.meta["shm"].shared[0]
    theirs = ray.get(other.hidden_storage.remote())
    forged = dataclasses.replace(sh, pid=theirs["pid"], fd=theirs["fd"], inode=theirs["inode"])
    _refused(c, _crafted(obj, shared=(forged,)), "TransferError", f"in process {theirs['pid']}, not in the producer")


def test_a_descriptor_the_producer_did_not_lend_for_the_object_is_never_opened(actors, made):
    p, _, c = actors
    obj = _get(made, p.weights.remote())
    sh = obj.meta["shm"].shared[0]
    hidden = ray.get(p.hidden_storage.remote())  # the producer's own, never returned
    forged = dataclasses.replace(sh, fd=hidden["fd"], inode=hidden["inode"])
    _refused(c, _crafted(obj, shared=(forged,)), "ObjectFreedError", f"descriptor {hidden['fd']}", "not the one its producer lent")
    _refused(c, _crafted(obj, shared=(dataclasses.replace(forged, key=0),)), "TransferError", "not one a producer lends")
    _refused(c, _crafted(obj, shared=(dataclasses.replace(sh, fd=-1),)), "TransferError", "not one a producer lends")
    # Another object's lent descriptor, with this object's key: not lent for this object.
    kept = _get(made, p.weights.remote())  # (alive meanwhile: its descriptor stays lent)
    again = kept.meta["shm"].shared[0]
    assert again.fd != sh.fd
    _refused(c, _crafted(obj, shared=(dataclasses.replace(sh, fd=again.fd),)), "ObjectFreedError", "not the one its producer lent")
    # Its whole record (descriptor, key and inode together): lent for the other object only.
    _refused(c, _crafted(obj, shared=(again,)), "ObjectFreedError", f"descriptor {again.fd}", "not the one its producer lent")
    # The object's own record with another view of the storage: the views are lent with it.
    _refused(c, _crafted(obj, shared=(dataclasses.replace(sh, stride=(0,)),)), "ObjectFreedError", "not the one its producer lent")
    assert ray.get(c.attempt.remote([kept]))["sums"] == [3.0 * BIG]  # its own ref reads it


def test_a_forged_producer_whose_descriptor_holds_a_secret_is_never_read(actors, made, tmp_path):
    # Another process of this user holds an unlinked file under /dev/shm, as a producer's
    # shared storage would be; a forged ref names that process as its producer.
    p, _, c = actors
    obj = _get(made, p.weights.remote())
    sh = obj.meta["shm"].shared[0]
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import os, sys\n"
            f"fd = os.open('/dev/shm/test-held-{uuid.uuid4().hex}', os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)\n"
            f"os.write(fd, b'{SECRET}' * 100000)\n"
            "os.unlink(os.readlink(f'/proc/self/fd/{fd}'))\n"
            "st = os.fstat(fd)\n"
            "print(fd, st.st_dev, st.st_ino, flush=True)\n"
            "sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None
        fd, dev, ino = (int(x) for x in holder.stdout.readline().split())
        owner = dataclasses.replace(obj.producer, token=f"{holder.pid}:0123456789ab")
        # Its position is whatever the holder made it, never a key of ours (nor the forger's guess).
        forged = dataclasses.replace(sh, pid=holder.pid, fd=fd, inode=(dev, ino))
        crafted = dataclasses.replace(_crafted(obj, shared=(forged,)), producer=owner)
        _refused(c, crafted, "ObjectFreedError", f"descriptor {fd} of process {holder.pid}", "not the one its producer lent")
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)


@pytest.mark.parametrize(
    ("stride", "offset", "words"),
    [
        ((BIG * 2,), 0, "reaches past its storage"),
        ((1,), BIG, "reaches past its storage"),
        ((-1,), 0, "is negative"),
        ((1, 1), 0, "stride (1, 1)"),
    ],
)
def test_a_view_past_its_shared_storage_is_refused(actors, made, stride, offset, words):
    p, _, c = actors
    obj = _get(made, p.weights.remote())
    sh = dataclasses.replace(obj.meta["shm"].shared[0], stride=stride, offset=offset)
    obj = _crafted(obj, shared=(sh,))
    if stride == (-1,):  # a negative stride is refused, not wrapped around
        obj = dataclasses.replace(obj, specs=(TensorSpec((2,), torch.float32, "cpu", 8),))
    _refused(c, obj, "TransferError", words)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (TensorSpec((-1,), torch.float32, "cpu", -4), "shape (-1,)"),
        (TensorSpec((N,), torch.float32, "cpu", 4), f"nbytes 4, where shape [{N}] of torch.float32 holds {4 * N}"),
        (TensorSpec((1 << 40, 1 << 40), torch.float32, "cpu", 1 << 82), "over 1125899906842624"),
        (TensorSpec((N,), "float32", "cpu", 4 * N), "dtype 'float32'"),  # type: ignore[arg-type]
        # a quantized tensor built from bytes has no quantizer: reading it crashes the process
        (TensorSpec((N,), torch.qint8, "cpu", N), "dtype torch.qint8 (quantized"),
        (TensorSpec((N,), torch.float32, "../../etc", 4 * N), "device '../../etc'"),
        (TensorSpec([N], torch.float32, "cpu", 4 * N), "shape [1000]"),  # type: ignore[arg-type]
        (TensorSpec((True,), torch.float32, "cpu", 4), "shape (True,)"),
    ],
)
def test_tensor_specs_no_producer_makes_are_refused(actors, made, spec, words):
    p, _, c = actors
    obj = dataclasses.replace(_get(made, p.make.remote(1.0)), specs=(spec,))
    _refused(c, obj, "TransferError", "tensor 0's spec is not one a producer makes", words)


def test_a_malformed_token_or_object_id_is_refused(actors, made):
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    bad = dataclasses.replace(obj, producer=dataclasses.replace(obj.producer, token="../1:x"))
    _refused(c, bad, "TransferError", "producer token '../1:x'")
    _refused(c, dataclasses.replace(obj, obj_id="../x"), "TransferError", "object id '../x'")
    _still_serves(p, c)


def test_a_skeleton_naming_a_tensor_it_does_not_have_is_refused(actors, made):
    from rdt_async._tree import Slot

    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    _refused(c, dataclasses.replace(obj, skeleton={"x": Slot(-1)}), "TransferError", "names tensor -1 of 1")


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("offsets", "do not match its 1 tensor(s)"),
        ("shared", "do not match its 1 tensor(s)"),
        ("segment", "is not a name of ours"),
        ("spec", "tensor 0's spec is not one a producer makes: shape (0, 0, 0"),
        ("token", "producer token '0:00000"),
    ],
)
def test_a_field_of_megabytes_makes_a_message_of_a_few_kilobytes(actors, made, field, words):
    # The refusal named the whole field: a crafted ref made a message of megabytes, which
    # every log and traceback it reached repeated.
    p, _, c = actors
    obj = _get(made, p.make.remote(1.0))
    if field == "spec":
        crafted = dataclasses.replace(obj, specs=(TensorSpec((0,) * 200_000, torch.float32, "cpu", 0),))
    elif field == "token":
        crafted = dataclasses.replace(obj, producer=dataclasses.replace(obj.producer, token="0:" + "0" * 1_000_000))
    else:
        crafted = _crafted(obj, **{field: {"offsets": (0,) * 200_000, "shared": (None,) * 200_000, "segment": "x" * 1_000_000}[field]})
    got = _refused(c, crafted, "TransferError", words)
    assert len(got["message"]) <= 4000 and "characters cut ..." in got["message"], len(got["message"])


def test_a_ref_with_another_actors_handle_is_refused_and_sends_no_later_ref_there(actors, made):
    """A ref carries its producer's handle (pickled) beside its token and actor id: one that
    pairs an honest producer's token and id with another actor's handle must not make this
    process send that producer's later refs' calls (frees, pings, sends) to the other actor."""
    from rdt_async import _object

    p, other, _ = actors
    mine, theirs = _get(made, p.make.remote(1.0)), _get(made, other.make.remote(SECRET))
    forged = dataclasses.replace(mine, producer=dataclasses.replace(mine.producer, actor_state=theirs.producer.actor_state))
    _object._handles.clear()  # (as a process that has not met either yet)
    with pytest.raises(rdt.TransferError, match=f"handle is not one of actor {mine.producer.actor_id[:16]}, which the ref names as its producer"):
        forged.producer.actor  # noqa: B018
    assert mine.producer.actor._ray_actor_id.hex() == mine.producer.actor_id  # the honest ref: its own actor
    assert theirs.producer.actor._ray_actor_id.hex() == theirs.producer.actor_id
