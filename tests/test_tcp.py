"""tcp between actors on two hosts, and its pieces: the split into streams, the token, reuse."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time

import pytest
import ray
import torch
from conftest import MAX_STALL_S, ON_NODE2, wait_until
from helpers import Probed

import rdt_async as rdt
from rdt_async import _io
from rdt_async.transports import _kit, _registry, tcp


def _sized(obj_id: str, x) -> int:
    """What a request names of the object's sizes (`_kit.sizes_digest`): of tensor `x` (or of `x` bytes)."""
    return _kit.sizes_digest(obj_id, [x if isinstance(x, int) else x.nbytes])

pytestmark = pytest.mark.usefixtures("ray_session")


def value(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    return {
        "w": w,
        "pair": (w[: n // 2], torch.arange(12).reshape(3, 4).t()),  # a view, a strided one
        "more": [torch.linspace(0, 1, 7).to(torch.bfloat16), torch.tensor([True, False]), torch.empty(0)],
        "seed": seed,
    }


def digest(t: torch.Tensor) -> str:
    """An exact digest (a float sum depends on how many threads add it up)."""
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def digests(v: dict) -> list:
    return [digest(v["w"]), digest(v["pair"][0]), v["pair"][1].tolist(), [digest(t) for t in v["more"]],
            [str(t.dtype) for t in v["more"]], v["seed"]]  # fmt: skip


@rdt.remote
class TcpProducer:
    @rdt.method(tensor_transport="tcp")
    def make(self, n: int, seed: int = 0):
        return value(n, seed)

    @rdt.method(tensor_transport="tcp")
    async def make_async(self, n: int, seed: int = 0):
        await asyncio.sleep(0)
        return value(n, seed)

    def held(self) -> int:
        return len(tcp._objects)

    def connections(self) -> int:
        return sum(t.name == "rdt-tcp-send" for t in threading.enumerate())


@rdt.remote
class TcpConsumer(Probed):
    async def check(self, v):
        return digests(v), rdt.store_stats()["fetches"]

    async def fetch_probed(self, refs):
        self.probe.start()
        v = await rdt.fetch(refs[0])
        lag = await self.probe.stop()
        return digests(v), lag, self.probe.report()

    async def cancel_then_fetch(self, refs):
        task = asyncio.ensure_future(rdt.fetch(refs[0]))
        await asyncio.sleep(0.005)
        task.cancel()
        first = "cancelled"
        try:
            await task
            first = "done"
        except asyncio.CancelledError:
            pass
        return first, digests(await rdt.fetch(refs[0]))

    async def fetch(self, refs):
        return digests(await rdt.fetch(refs[0]))

    def idle(self) -> int:
        return sum(len(p) for p in tcp._idle.values())

    def idle_to(self) -> dict:
        """The connections kept for reuse, by the listener they go to."""
        return {key[:2]: len(p) for key, p in tcp._idle.items() if p}

    def fetches(self) -> dict:
        return rdt.store_stats()["fetches"]


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer on another host, shared by the tests that kill neither."""
    p, c = TcpProducer.remote(), TcpConsumer.options(**ON_NODE2).remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


def test_values_cross_hosts_intact_sync_and_async_producers(pair):
    p, c = pair
    before = ray.get(c.fetches.remote()).get("tcp", 0)  # (its fetches so far)
    got, used = ray.get(c.check.remote(p.make.remote(1000, 1)))
    assert got == digests(value(1000, 1)) and used == {"tcp": before + 1}
    got, used = ray.get(c.check.remote(p.make_async.remote(3 << 20, 2)))  # 18 MiB (w and a view of half)
    assert got == digests(value(3 << 20, 2)) and used == {"tcp": before + 2}
    # Four streams; a stream that starts after another ended reuses its connection, so 1 to 4
    # were opened (a loaded machine opens fewer). Every one opened waits for the next fetch, and
    # the producer serves exactly those: none dropped, none leaked.
    idle = ray.get(c.idle.remote())
    assert 1 <= idle <= 4 and ray.get(p.connections.remote()) == idle


def test_a_big_fetch_leaves_the_consumers_loop_free(pair):
    p, c = pair
    ray.get(c.fetch.remote([p.make.remote(1000, 0)]))  # connected
    got, lag, report = ray.get(c.fetch_probed.remote([p.make.remote(16 << 20, 3)]))  # 64 MiB
    assert got == digests(value(16 << 20, 3))
    assert lag < MAX_STALL_S, f"the consumer's loop during a 64 MiB tcp fetch: {report}"


def test_cancel_mid_fetch_then_fetch_again(pair):
    p, c = pair
    first, got = ray.get(c.cancel_then_fetch.remote([p.make.remote(16 << 20, 5)]))
    assert first in ("cancelled", "done") and got == digests(value(16 << 20, 5))


def test_objects_are_released_and_a_freed_one_says_so(pair):
    p, c = pair
    wait_until(lambda: ray.get(p.held.remote()) == 0, 15, lambda: "the tests before's objects released")
    refs = [p.make.remote(1000, i) for i in range(5)]
    ray.wait(refs, num_returns=5)
    assert ray.get(p.held.remote()) == 5
    del refs
    wait_until(lambda: ray.get(p.held.remote()) == 0, 15, lambda: f"{ray.get(p.held.remote())} objects held")
    ref = p.make.remote(10, 0)
    ray.wait([ref])
    rdt.free(ref)  # asks the producer, fire and forget: a fetch racing it may still win
    wait_until(lambda: ray.get(p.held.remote()) == 0, 15, lambda: f"{ray.get(p.held.remote())} objects held")
    with pytest.raises(rdt.ObjectFreedError):
        ray.get(c.fetch.remote([ref]))


def test_producer_killed_gives_peer_died_in_bounded_time(pair):
    _, c = pair  # the shared consumer (it must serve on); a producer of its own, killed
    p = TcpProducer.remote()
    before = ray.get(c.idle_to.remote())
    ray.get(c.fetch.remote([p.make.remote(100, 0)]))  # a connection kept for reuse
    kept = ray.get(c.idle_to.remote()).keys() - before.keys()
    assert len(kept) == 1, kept  # (the new producer's listener)
    ref = p.make.remote(1000, 1)
    ray.wait([ref])
    ray.kill(p)
    time.sleep(0.5)
    t0 = time.monotonic()
    with pytest.raises(rdt.PeerDiedError):
        ray.get(c.fetch.remote([ref]), timeout=60)
    assert time.monotonic() - t0 < 30
    left = ray.get(c.idle_to.remote())
    assert not kept & left.keys(), left  # the dead producer's connections were dropped
    assert ray.get(c.fetch.remote([pair[0].make.remote(100, 2)])) == digests(value(100, 2))  # it serves on


def test_streams_split_the_bytes_into_page_aligned_ranges():
    mib = 1 << 20
    assert tcp._plan([1000], 4) == [[(0, 0, 1000)]]  # small: one stream
    plans = tcp._plan([10 * mib, 0, 6 * mib], 4)  # 16 MiB: four streams of 4 MiB
    assert plans == [[(0, 0, 4 * mib)], [(0, 4 * mib, 4 * mib)], [(0, 8 * mib, 2 * mib), (2, 0, 2 * mib)],
                     [(2, 2 * mib, 4 * mib)]]  # fmt: skip
    assert tcp._plan([64 * mib + 1], 4)[0][0][2] % 4096 == 0
    assert sum(n for p in tcp._plan([64 * mib + 1, 3], 4) for _, _, n in p) == 64 * mib + 4
    assert tcp._plan([0, 0], 4) == [[]]


def test_a_connection_without_the_token_is_closed_unserved():
    t = _registry.transport("tcp")
    meta = t.prepare("secret-obj", [torch.arange(10)])
    try:
        with socket.create_connection((meta.host, meta.port), timeout=10) as s:
            assert tcp._recv_exact(s, 16) == tcp._greeting(meta.token)  # the listener greets first
            got = b""
            try:
                s.sendall(tcp.MAGIC + bytes(16))  # a wrong token
                s.sendall(tcp._HEAD.pack(10, 1, 0) + b"secret-obj" + tcp._PART.pack(0, 0, 80))
                got = s.recv(100)
            except (ConnectionResetError, BrokenPipeError):
                pass  # closed on us (a reset, where our request was still unread)
            assert got == b""  # closed, nothing sent
        got = asyncio.run(_fetch(t, meta))  # the right token is served
        assert torch.equal(got[0], torch.arange(10))
    finally:
        t.garbage_collect("secret-obj", meta)


async def _fetch(t, meta):
    from rdt_async.transports._base import FetchRequest, TensorSpec, TransferInfo

    info = TransferInfo("secret-obj", (TensorSpec.of(torch.arange(10)),), meta)
    return await FetchRequest.start(t, info).wait()


def test_bad_stream_setting_names_the_fix(monkeypatch):
    for bad in ("0", "two"):
        monkeypatch.setenv("RDT_TCP_STREAMS", bad)
        with pytest.raises(ValueError, match=f"RDT_TCP_STREAMS='{bad}': give the number of connections per fetch"):
            tcp._streams()
    monkeypatch.setenv("RDT_TCP_STREAMS", "2")
    assert tcp._streams() == 2


def _fill_accept_queue(server: socket.socket) -> list[socket.socket]:
    """Connect to a listener that never accepts until its queue is full (its length is the
    kernel's business): a later connect's SYN is dropped. The connections made (close
    them); skips the test where the kernel accepted every one."""
    made = []
    for _ in range(8):
        s = socket.socket()
        s.settimeout(0.2)
        if s.connect_ex(server.getsockname()) != 0:
            s.close()
            return made
        made.append(s)
    for s in made:
        s.close()
    pytest.skip("the kernel accepted every connection: no full queue to time out on")


def test_a_producer_that_does_not_answer_is_a_transfer_error_not_a_timeout(monkeypatch):
    """A connect that times out is the transfer's failure (so the core asks Ray whether the
    producer died), never the builtin TimeoutError that means the caller's own deadline."""
    from rdt_async._errors import translating

    monkeypatch.setattr(tcp, "CONNECT_S", 0.3)
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # never accepted: one connection fills the queue, later SYNs are dropped
        waiting = []
        try:
            waiting += _fill_accept_queue(full)
            meta = tcp.TcpMeta(*full.getsockname(), bytes(16))
            t0 = time.monotonic()
            with pytest.raises(rdt.TransferError, match=r"failed in tcp: Unreachable: cannot reach the producer's tcp listener at 127\.0\.0\.1:\d+ \(no answer in 0\.3 s \(RDT_TCP_CONNECT_S\): a firewall drops that port, or no host has that address\); where the producer runs, set RDT_TCP_HOST"):
                with translating("tcp fetch of obj", "obj", transport=_registry.transport("tcp")):
                    tcp._connect(meta)
            assert time.monotonic() - t0 < 5
        finally:
            for s in waiting:
                s.close()


def test_rdt_tcp_connect_s_sets_how_long_a_connect_waits_for_an_answer(monkeypatch):
    """Behind a firewall that drops the producer's port, `auto` falls back only once the
    connect gives up: that was 10 s, with no setting (a user's first fetch of each
    firewalled host paid it)."""
    monkeypatch.setenv("RDT_TCP_CONNECT_S", "1")
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        waiting = []
        try:
            waiting += _fill_accept_queue(full)
            meta = tcp.TcpMeta(*full.getsockname(), bytes(16))
            t0 = time.monotonic()
            with pytest.raises(tcp.Unreachable, match=r"\(no answer in 1 s \(RDT_TCP_CONNECT_S\)"):
                tcp._connect(meta)
            assert 0.9 < time.monotonic() - t0 < 3
        finally:
            for s in waiting:
                s.close()
    for bad in ("0", "2s", "-1"):
        monkeypatch.setenv("RDT_TCP_CONNECT_S", bad)
        with pytest.raises(ValueError, match=rf"RDT_TCP_CONNECT_S='{bad}': give the seconds a connect to a producer may take \(1 or more\)"):
            tcp._connect(tcp.TcpMeta("127.0.0.1", 9, bytes(16)))


@pytest.mark.parametrize("says", ["greeting", "held"], ids=["no-answer", "answer-then-nothing"])
def test_a_listener_that_says_nothing_fails_the_fetch_after_the_stall_time(monkeypatch, says):
    """A ref's address is input: a listener that greets and then says nothing (or says
    HELD and sends no byte) must not hold a fetch for good (nor its thread)."""
    from rdt_async._errors import translating

    monkeypatch.setenv("RDT_TCP_STALL_S", "1")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        accepted = []

        def accept() -> None:
            conn, _ = silent.accept()
            accepted.append(conn)
            conn.sendall(tcp._greeting(bytes(16)))
            if says == "held":
                conn.recv(4096)  # (the token and the request)
                conn.sendall(tcp.HELD)

        threading.Thread(target=accept, daemon=True).start()
        meta = tcp.TcpMeta(*silent.getsockname(), bytes(16))
        fetch = tcp._Fetch()
        t0 = time.monotonic()
        said = "mid-transfer" if says == "held" else "no answer to the request"
        with pytest.raises(rdt.TransferError, match=rf"tcp fetch of obj: the producer's listener at 127\.0\.0\.1:\d+ sent nothing for 1 s \({said}\); RDT_TCP_STALL_S sets how long a fetch waits"):
            with translating("tcp fetch of obj", "obj", transport=_registry.transport("tcp")):
                tcp._stream_once(fetch, meta, "obj", 0, [(0, 0, 64)], [memoryview(bytearray(64))], None, reuse=False)
        assert time.monotonic() - t0 < 5
        for conn in accepted:
            conn.close()


@pytest.mark.parametrize("greets", [None, b"+OK ready here\r\n", "another token"])
def test_a_ref_naming_another_service_sends_it_nothing(monkeypatch, greets):
    """A ref's address, port and token are input: a consumer that sent `RDT1` and the token
    first handed a crafted ref's 16 bytes to whatever listened there (a line-based service
    without auth read a command in them). It sends nothing until the producer's listener
    proves it knows the token; a silent or other service is Unreachable (auto takes another path)."""
    from rdt_async._errors import translating

    monkeypatch.setattr(tcp, "CONNECT_S", 1.0)
    with socket.socket() as service:
        service.bind(("127.0.0.1", 0))
        service.listen(1)
        heard: list[bytes] = []

        def serve() -> None:
            conn, _ = service.accept()
            with conn:
                if greets is not None:
                    conn.sendall(tcp._greeting(b"x" * 16) if greets == "another token" else greets)
                conn.settimeout(3)
                try:
                    while chunk := conn.recv(4096):
                        heard.append(chunk)
                except OSError:
                    pass

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        meta = tcp.TcpMeta(*service.getsockname(), b"FLUSHALL\r\n\r\n\r\n\r\n\r")
        why = "no greeting in 1 s" if greets is None else "its greeting is not the one the ref's token asks for"
        with pytest.raises(rdt.TransferError, match=rf"Unreachable: the listener at 127\.0\.0\.1:\d+ is not the producer's tcp listener \({why}\); nothing was sent to it"):
            with translating("tcp fetch of obj", "obj", transport=_registry.transport("tcp")):
                tcp._stream_once(tcp._Fetch(), meta, "obj", 0, [(0, 0, 64)], [memoryview(bytearray(64))], None, reuse=False)
        server.join(10)
        assert heard == [], heard


def test_idle_connections_are_closed_after_idle_s(monkeypatch):
    """A consumer keeps connections for the next fetch, not for good: a producer it never
    fetches from again (gone, or done) would otherwise keep them open for the process's life."""
    monkeypatch.setattr(tcp, "IDLE_S", 0.3)
    monkeypatch.setattr(tcp, "_sweeper", tcp._segments.IdleSweep(tcp._sweep, lambda: tcp.IDLE_S))  # none pending
    t = tcp.TcpTransport()
    x = torch.arange(1 << 20, dtype=torch.float32)
    meta = t.prepare("idle-conns", [x])
    got = torch.empty_like(x)
    try:
        assert tcp._stream(tcp._Fetch(), meta, "idle-conns", _sized("idle-conns", x), [(0, 0, x.nbytes)], [tcp._raw(got)])
        assert torch.equal(got, x)
        key = (meta.host, meta.port, meta.token)
        (sock, _), = tcp._idle[key]  # kept for reuse
        assert sock.fileno() >= 0
        wait_until(lambda: key not in tcp._idle and sock.fileno() == -1, timeout=10, what=lambda: "the idle connection closed")
    finally:
        t.garbage_collect("idle-conns", meta)


def test_a_send_to_a_host_that_vanished_gives_up_and_lets_the_tensors_go(monkeypatch):
    """A consumer's host drops off the network mid-fetch: the producer's send must fail in
    bounded time (TCP_USER_TIMEOUT), not retry for ~15 min keeping the object's tensors."""
    import os
    import subprocess
    import sys
    import weakref

    from rdt_async.bench._hosts import Hosts

    why = Hosts.unavailable()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(tcp, "USER_TIMEOUT_S", 2.0)
    t = tcp.TcpTransport()
    meta = t.prepare("vanish", [torch.ones(16 << 20)])  # 64 MiB: far more than the socket buffers hold
    held = weakref.ref(tcp._objects["vanish"][0])
    v6 = ":" in meta.host  # (RDT_TEST_TOPOLOGY=split6: Ray's node IP is an IPv6 one)
    hosts = Hosts("split6" if v6 else "flat")
    consumer = None
    try:
        link = hosts._first
        # The listener binds the address it advertises (Ray's node IP, or the default
        # route's): the consumer's host reaches it through its link to this one.
        route = f"{meta.host}/{128 if v6 else 32}"
        subprocess.run(["ip", "netns", "exec", link.name, "ip", "route", "add", route, "via", link.root_ip], check=True)
        request = tcp._HEAD.pack(6, 1, _sized("vanish", 64 << 20)) + b"vanish" + tcp._PART.pack(0, 0, 64 << 20)
        code = (
            "import socket, sys, time\n"
            f"s = socket.create_connection(({meta.host!r}, {meta.port}))\n"
            "greeting = b''\n"
            "while len(greeting) < 16: greeting += s.recv(16 - len(greeting))\n"
            f"s.sendall({tcp.MAGIC + meta.token!r} + {request!r})\n"
            "assert s.recv(1) == b'\\x01'\n"
            "print('reading stopped', flush=True)\n"
            "time.sleep(120)\n"  # reads nothing more: the producer's send blocks
        )
        consumer = subprocess.Popen(
            ["ip", "netns", "exec", link.name, sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        line = consumer.stdout.readline()
        assert line.strip() == "reading stopped", line + consumer.stdout.read()
        t.garbage_collect("vanish", meta)  # freed: only the send in flight holds the tensor now
        time.sleep(0.5)  # the producer's send fills the buffers and waits for room
        assert held() is not None
        link.set_up(False)  # the consumer's host is gone
        t0 = time.monotonic()
        wait_until(lambda: held() is None, timeout=20, what=lambda: "the producer's send to let the tensor go")
        print(f"\nthe send gave up {time.monotonic() - t0:.1f} s after the host vanished")
    finally:
        t.garbage_collect("vanish", meta)
        if consumer is not None:
            os.kill(consumer.pid, 9)
            consumer.wait()
        hosts.close()


async def test_a_cancel_does_not_wait_for_streams_queued_behind_other_fetches(monkeypatch):
    """The receiving threads are shared: behind fetches stuck on a dead peer (up to ~30 s
    each) a new fetch's streams queue. Cancelling it takes them out of the queue: it
    returns at once, and none of them runs (nothing lands in `into=` later)."""
    import concurrent.futures

    from rdt_async.transports._base import TensorSpec, TransferInfo

    pool = concurrent.futures.ThreadPoolExecutor(1)
    monkeypatch.setitem(_io._pools, tcp.STREAMS, pool)
    release = threading.Event()
    pool.submit(release.wait, 30)  # the one thread is busy elsewhere
    t = tcp.TcpTransport()
    x = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB: 4 streams
    meta = t.prepare("queued", [x])
    into = torch.zeros_like(x)
    try:
        task = asyncio.ensure_future(t.receive(TransferInfo("queued", (TensorSpec.of(x),), meta), [into], None))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
        pool.shutdown(wait=True)
        t.garbage_collect("queued", meta)
    assert into.count_nonzero().item() == 0  # none of its streams ran


def test_a_kept_connection_found_dead_is_replaced_once(monkeypatch):
    """A connection kept for reuse whose producer end went while it was idle (a network blip
    since healed): the next fetch connects anew instead of failing with a TransferError."""
    t = tcp.TcpTransport()
    x = torch.arange(1 << 20, dtype=torch.float32)
    meta = t.prepare("stale", [x])
    key = (meta.host, meta.port, meta.token)
    dead, gone = socket.socketpair()
    gone.close()  # its peer is gone: a send fails (EPIPE) or the answer is EOF
    try:
        tcp._forget(meta)
        with tcp._idle_lock:
            tcp._idle[key] = [(dead, time.monotonic())]
        got = torch.empty_like(x)
        assert tcp._stream(tcp._Fetch(), meta, "stale", _sized("stale", x), [(0, 0, x.nbytes)], [tcp._raw(got)])
        assert torch.equal(got, x) and dead.fileno() == -1
        assert [s.fileno() >= 0 for s, _ in tcp._idle[key]] == [True]  # the new one is kept
    finally:
        tcp._forget(meta)
        t.garbage_collect("stale", meta)


def test_wait_tensor_freed_waits_for_a_send_in_flight_after_a_free():
    """A producer frees an object while a consumer's fetch of it is mid-send, then waits
    for its tensor to be free to write it in place (a trainer's step): the wait must last
    until the send has read the bytes, or the consumer gets a torn value."""
    from rdt_async._store import StoredObject, store

    t = tcp.TcpTransport()
    t.store = store  # handed in, as the core's registry does
    w = torch.full((16 << 20,), 1.0)  # 64 MiB: far more than the socket buffers hold
    meta = t.prepare("in-flight", [w])
    store.add("in-flight", StoredObject([w], {t: meta}))
    sock = socket.create_connection((meta.host, meta.port))
    try:
        assert tcp._recv_exact(sock, 16) == tcp._greeting(meta.token)
        sock.sendall(tcp.MAGIC + meta.token + tcp._HEAD.pack(9, 1, _sized("in-flight", w)) + b"in-flight" + tcp._PART.pack(0, 0, w.nbytes))
        assert tcp._recv_exact(sock, 1) == tcp.HELD
        time.sleep(0.2)  # the send fills the buffers and waits: we read no more for now
        assert store.free("in-flight")
        assert not store.wait_freed_blocking(w, 0.5), "free while a send reads it"
        got = torch.empty_like(w)
        reader = threading.Thread(target=tcp._recv_into, args=(sock, tcp._raw(got)))
        reader.start()
        assert store.wait_freed_blocking(w, 30)
        w.fill_(2.0)  # the step, once free
        reader.join(30)
        assert torch.equal(got, torch.full_like(w, 1.0))
    finally:
        sock.close()
        t.garbage_collect("in-flight", meta)


def test_an_answer_of_many_ranges_arrives_whole_and_in_order():
    # Small ranges leave joined up to PACKED_BYTES a send, large ones alone: every byte
    # arrives in order, across the joins' edges, and a range past its tensor is refused.
    g = torch.Generator().manual_seed(3)
    sizes = [1, 0, 7, tcp.PACKED_BYTES - 1, 1, tcp.PACKED_BYTES, tcp.PACKED_BYTES + 1, 3, *[513] * 300, 5 << 20, 2]
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    parts = [(i, 0, n) for i, n in enumerate(sizes)] + [(6, 5, 100)]  # (and a range inside one)
    a, b = socket.socketpair()
    want = b"".join(bytes(tensors[i][off : off + n].numpy()) for i, off, n in parts)
    got = bytearray(len(want) + 1)
    reader = threading.Thread(target=tcp._recv_into, args=(b, memoryview(got)))
    reader.start()
    try:
        assert tcp._send_parts(a, "obj", tensors, parts)
        reader.join(30)
        assert not reader.is_alive() and got[:1] == tcp.HELD and bytes(got[1:]) == want
        with pytest.raises(ConnectionAbortedError, match=r"a request for bytes 0\.\.2 of tensor 0 of obj"):
            tcp._send_parts(a, "obj", tensors, [(0, 0, 2)])
        with pytest.raises(ConnectionAbortedError, match="of tensor 9999 of obj"):
            tcp._send_parts(a, "obj", tensors, [(9999, 0, 1)])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("silent", ["no greeting", "no accept"])
def test_a_cancel_ends_a_connect_and_the_wait_for_the_greeting_at_once(silent):
    """A fetch's socket is the fetch's from the start: a cancel while it connects (a silent
    network) or waits for the greeting (a stopped producer still accepts) returned only
    after CONNECT_S (10 s), with the caller's deadline long past."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        waiting = []
        try:
            if silent == "no accept":  # later SYNs are dropped
                waiting += _fill_accept_queue(server)
            fetch = tcp._Fetch()
            threading.Timer(0.3, fetch.cancel).start()
            began = time.monotonic()
            with pytest.raises(OSError):
                tcp._stream_once(fetch, tcp.TcpMeta(*server.getsockname(), bytes(16)), "obj", 0, [(0, 0, 64)],
                                 [memoryview(bytearray(64))], None, reuse=False)
            assert time.monotonic() - began < 2, time.monotonic() - began
            assert fetch.socks == []
        finally:
            for s in waiting:
                s.close()
