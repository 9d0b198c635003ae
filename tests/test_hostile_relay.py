"""What a node relay's claimer hands an asker is input: crafted answers over the real socket.

A fake claimer of this process binds the object's abstract unix socket (as the first
consumer of a node does) and answers the asker -- `_relay.fetch`, the code under test --
with crafted bytes and real descriptors passed with SCM_RIGHTS. Whatever it sends, the
asker reads the object for itself and gets its right values, maps nothing it was sent,
and closes every descriptor it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import signal
import socket
import threading

import pytest
import torch
from test_relay import SPECS, Network, _fds, _obj_id, _values, no_warm_memfds  # noqa: F401  (an autouse fixture)

from rdt_async import _relay
from rdt_async.transports import _mappings

SIZE = _relay._layout(SPECS)[1]
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what the claimer seals its memfds with


def _memfd(nbytes: int = SIZE, seals: int = SEALS) -> int:
    """A memfd of `nbytes` zeros, sealed with `seals` (the asker's own read is never zeros)."""
    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _framed(msg: bytes, then: bytes = _relay.DONE) -> bytes:
    """`msg` as the claimer's first message frames it, and `then` (ranges; DONE: all landed)."""
    return _relay._FRAME.pack(len(msg)) + msg + then


def _answer(obj: str, then: bytes = _relay.DONE, **fields) -> bytes:
    return _framed(json.dumps({"obj_id": obj, "size": SIZE, **fields}).encode(), then)


def _range(i: int, off: int, n: int) -> bytes:
    return _relay._RANGE.pack(i, off, n)


@contextlib.contextmanager
def _fake_claimer(obj: str, reply):
    """Hold `obj`'s claim; answer each asker with `reply(conn, obj)` -> descriptors to close afterwards."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    claim.bind(_relay._address(obj))
    claim.listen(8)
    claim.settimeout(0.2)
    stop, opened, conns = threading.Event(), [], []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = claim.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            opened.extend(reply(conn, obj))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield
    finally:
        stop.set()
        server.join(5)
        for c in (claim, *conns):
            c.close()
        for fd in opened:
            os.close(fd)


def _sends(msg, *make_fds, then_close: bool = False):
    """A reply: `msg` (bytes, or a function of the object id) and the descriptors `make_fds`
    make (`then_close`: and the connection closes, as a claimer's does when its read fails)."""

    def reply(conn, obj):
        fds = [make() for make in make_fds]
        socket.send_fds(conn, [msg(obj) if callable(msg) else msg], fds)
        if then_close:
            conn.close()
        return fds

    return reply


def _reopened(flags: int):
    def make():
        fd = _memfd()
        try:
            return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
        finally:
            os.close(fd)

    return make


def _pipe():
    r, w = os.pipe()
    os.close(w)
    return r


def _file_on_disk(tmp_path):
    def make():
        fd = os.open(tmp_path / "forged", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, SIZE)
        return fd

    return make


def _closes_at_once(conn, obj):
    conn.close()
    return []


def _cases(tmp_path):
    """(what the claimer sends, what the asker's warning says, or None where it hears nothing)."""
    return {
        # As before: the claimer's read failed (EOF), another object, no descriptor.
        "an early close": (_closes_at_once, None),
        "another object": (_sends(_answer("0" * 16), _memfd), "for object '0000000000000000'"),
        "no descriptor": (_sends(_answer), "with 0 descriptors, not one memfd"),
        # New: each was mapped, or raised out of the fetch, before.
        "bytes that are not json": (_sends(_framed(b"\xff\x00 not json"), _memfd), "with bytes that are not an answer"),
        "json that is not a dict": (_sends(_framed(b"[1, 2]"), _memfd), "with bytes that are not an answer"),
        "a size that is a float": (
            _sends(lambda obj: _framed(b'{"obj_id": "%s", "size": %d.0}' % (obj.encode(), SIZE)), _memfd),
            "with bytes that are not an answer",
        ),
        "an answer with no frame": (
            _sends(lambda obj: json.dumps({"obj_id": obj, "size": SIZE}).encode(), _memfd),
            "with bytes that are not an answer",
        ),
        "a frame longer than what came": (
            _sends(lambda obj: _relay._FRAME.pack(1 << 20) + _answer(obj)[4:], _memfd),
            "with bytes that are not an answer",
        ),
        # The ranges that follow an answer, as the claimer's read lands them.
        "a range past a tensor's end": (
            _sends(lambda obj: _answer(obj, _range(0, SPECS[0].nbytes - 8, 16) + _relay.DONE), _memfd),
            f"with a range (0, {SPECS[0].nbytes - 8}, 16) outside the object",
        ),
        "a range of a tensor the object lacks": (
            _sends(lambda obj: _answer(obj, _range(2, 0, 8) + _relay.DONE), _memfd),
            "with a range (2, 0, 8) outside the object",
        ),
        "an empty range": (_sends(lambda obj: _answer(obj, _range(1, 0, 0)), _memfd), "with a range (1, 0, 0) outside"),
        "a range after DONE": (_sends(lambda obj: _answer(obj, _relay.DONE + _range(1, 0, 8)), _memfd), "after DONE"),
        "bytes after DONE": (_sends(lambda obj: _answer(obj, _relay.DONE + b"xyz"), _memfd), "with 3 bytes after DONE"),
        "a close before DONE": (_sends(lambda obj: _answer(obj, _range(1, 0, 8)), _memfd, then_close=True), None),
        "a field more": (_sends(lambda obj: _answer(obj, path="/etc/passwd"), _memfd), "not an answer"),
        "two memfds": (_sends(_answer, _memfd, _memfd), "with 2 descriptors, not one memfd"),
        "three memfds": (_sends(_answer, _memfd, _memfd, _memfd), "with 2+ descriptors, not one memfd"),
        "a pipe": (_sends(_answer, _pipe), "with a descriptor that is not a sealed memfd"),
        "a directory": (
            _sends(_answer, lambda: os.open(tmp_path, os.O_RDONLY | os.O_CLOEXEC)),
            "with a descriptor that is not a sealed memfd",
        ),
        "a file on disk": (_sends(_answer, _file_on_disk(tmp_path)), "with a descriptor that is not a sealed memfd"),
        "an unsealed memfd": (_sends(_answer, lambda: _memfd(seals=0)), "not a sealed memfd"),
        "a memfd sealed but for shrinking": (
            _sends(_answer, lambda: _memfd(seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)),
            "not a sealed memfd",
        ),
        "a memfd shorter than the object": (
            _sends(_answer, lambda: _memfd(SIZE - 4096)),
            f"with a memfd of {SIZE - 4096} bytes, not {SIZE} to {1 << 21}",
        ),
        "a memfd of a TiB": (_sends(_answer, lambda: _memfd(1 << 40)), f"with a memfd of {1 << 40} bytes"),
        "a write-only memfd": (_sends(_answer, _reopened(os.O_WRONLY)), "with a descriptor we cannot read"),
        "an O_PATH memfd": (_sends(_answer, _reopened(os.O_PATH)), "with a descriptor we cannot read"),
    }


CASES = list(_cases(None))


class IntoNetwork(Network):
    """A read into the caller's `into=` buffers (as `transfer()` with buffers does)."""

    def __init__(self, buffers) -> None:
        super().__init__()
        self.buffers = buffers

    async def __call__(self):
        for b, v in zip(self.buffers, await super().__call__()):
            b.copy_(v)
        return self.buffers


@pytest.mark.parametrize("into", [False, True], ids=["views", "into"])
@pytest.mark.parametrize("case", CASES)
async def test_an_asker_handed_anything_but_the_sealed_memfd_of_its_object_reads_for_itself(case, into, tmp_path, caplog):
    """With `into=` buffers the asker copies each range it is told of there as it comes:
    whatever it was told, they end holding its own read."""
    reply, warned = _cases(tmp_path)[case]
    before = _fds()
    obj = _obj_id()
    mine = [torch.full(s.shape, 3, dtype=s.dtype) for s in SPECS] if into else None
    net = IntoNetwork(mine) if into else Network()
    said = {k: _relay.counts.done[k] for k in ("unanswered", "refused", "gave_up")}
    with caplog.at_level(logging.WARNING, logger="rdt_async"), _fake_claimer(obj, reply):
        tensors, relayed = await asyncio.wait_for(_relay.fetch(obj, SPECS, net, buffers=mine), 10)
    assert (relayed, net.reads) == (False, 1)  # it mapped nothing it was sent, and read it itself
    counted = {k: _relay.counts.done[k] - n for k, n in said.items()}  # why, in store_stats()["relay"]
    assert sum(counted.values()) == 1 and counted["gave_up"] == 0, counted
    assert (counted["refused"] == 1) == (warned is not None), (counted, warned)
    assert all(torch.equal(t, v) for t, v in zip(tensors, _values()))
    if into:
        assert all(t is b for t, b in zip(tensors, mine))
    if warned is None:
        assert "answered" not in caplog.text
    else:
        assert f"the consumer of this node holding object {obj} answered " in caplog.text
        assert warned in caplog.text
    del tensors
    _mappings.cache.clear()
    assert _fds() <= before, _fds() - before  # every descriptor it was sent is closed, and the socket


def test_the_memfds_a_claimer_hands_out_cannot_change_size_under_an_askers_mapping():
    memfd = _relay.memfds.take(SIZE)  # a new one, as the claimer of an object takes it
    try:
        assert fcntl.fcntl(memfd.fd, fcntl.F_GET_SEALS) == SEALS
        for nbytes in (0, memfd.capacity // 2, memfd.capacity * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(memfd.fd, nbytes)
        assert os.fstat(memfd.fd).st_size == memfd.capacity
    finally:
        _relay.memfds.give(memfd)


def _truncated_under_the_asker(obj: str) -> None:
    """A claimer that hands over the right bytes in an unsealed memfd, and cuts it once the
    asker has its answer; the asker then reads its tensors (a SIGBUS if it mapped it)."""
    import asyncio

    async def main():
        offsets, size = _relay._layout(SPECS)
        fd = _memfd(_relay._Memfds.capacity(size), seals=0)
        for t, off in zip(_values(), offsets):
            os.pwrite(fd, t.numpy().tobytes(), off)
        with _fake_claimer(obj, _sends(_answer(obj), lambda: os.dup(fd))):
            tensors, _ = await _relay.fetch(obj, SPECS, Network())
        os.ftruncate(fd, 0)
        assert all(torch.equal(t, v) for t, v in zip(tensors, _values()))

    asyncio.run(main())


def test_a_memfd_cut_after_it_was_handed_over_cannot_kill_the_asker():
    proc = multiprocessing.get_context("spawn").Process(target=_truncated_under_the_asker, args=(_obj_id(),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"the asker died of {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else proc.exitcode



def test_a_node_shares_a_read_only_between_refs_that_say_the_same_of_it():
    """The relay's name for an object binds everything its ref says of the bytes: a ref that
    carries an honest object's id with another producer, transport, specs or metadata (a
    forged one) neither serves its bytes to the honest object's consumers nor is served
    theirs without its own metadata checked."""
    from rdt_async._object import Process
    from rdt_async.transports.tcp import TcpMeta

    obj_id = "ab" * 28
    producer = Process("cd" * 28, "4242:0a1b2c", "ef" * 16)
    meta = TcpMeta("10.0.0.2", 40000, b"t" * 16)
    honest = _relay.name_of(obj_id, producer, "tcp", tuple(SPECS), meta)
    assert honest == _relay.name_of(obj_id, Process("cd" * 28, "4242:0a1b2c", "ef" * 16), "tcp", tuple(SPECS), TcpMeta("10.0.0.2", 40000, b"t" * 16))
    assert honest.startswith(obj_id + "/")
    forged = [
        _relay.name_of(obj_id, Process("cd" * 28, "4243:0a1b2c", "ef" * 16), "tcp", tuple(SPECS), meta),  # another process
        _relay.name_of(obj_id, Process("ce" * 28, "4242:0a1b2c", "ef" * 16), "tcp", tuple(SPECS), meta),  # another node
        _relay.name_of(obj_id, Process("cd" * 28, "4242:0a1b2c", "ee" * 16), "tcp", tuple(SPECS), meta),  # another actor
        _relay.name_of(obj_id, producer, "ucxx", tuple(SPECS), meta),
        _relay.name_of(obj_id, producer, "tcp", tuple(SPECS[:1]), meta),
        _relay.name_of(obj_id, producer, "tcp", tuple(SPECS), TcpMeta("10.0.0.9", 40000, b"t" * 16)),  # the attacker's listener
        _relay.name_of(obj_id, producer, "tcp", tuple(SPECS), TcpMeta("10.0.0.2", 40000, b"u" * 16)),
    ]
    assert len(set(forged)) == len(forged) and honest not in forged
    long = _relay.name_of("x" * 4096, producer, "tcp", tuple(SPECS), meta)  # an id of any length: a name that binds
    assert len(_relay._address(long)) <= 107 and long != _relay.name_of("x" * 4097, producer, "tcp", tuple(SPECS), meta)
