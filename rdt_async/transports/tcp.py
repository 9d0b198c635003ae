"""`tcp`: CPU tensors over plain TCP sockets, several streams at once; nothing to install.

One TCP stream is bound by the one core that copies it through the kernel at each end:
on a 2-core VM across a veth link, 64 MiB take ~50 ms in one stream and ~27 ms in two.
A large object is split into byte ranges fetched over up to `RDT_TCP_STREAMS`
connections at once (default 4, one per `STREAM_MIN_BYTES`), each served by its own
thread on both sides (the GIL is released in `send`/`recv_into`).

A producer that prepares `tcp` listens once (a thread accepting connections, one thread
per connection) on an ephemeral port (one of `RDT_PORT_RANGE` where set) of the address
its node is known by (Ray's node IP, or `RDT_TCP_HOST` / `RDT_ADVERTISE_HOST`: see
`_net`); that address and a random 128-bit token travel in the `RDTObject`. A connection starts with the token, so only who holds a ref of this
producer is served (nothing is encrypted: see Network and trust in the docs). A consumer
keeps up to `IDLE_CONNECTIONS` idle connections per producer for reuse, each closed once
unused for `IDLE_S`. A peer whose host vanished is given up on after ~30 s either way:
keepalive probes an idle connection, `TCP_USER_TIMEOUT` bounds bytes left unacknowledged
(a producer's send would otherwise retry for ~15 min, holding the tensors it reads). A
request, and its answer:

    consumer                                          producer
    --------                                          --------
    obj_id, [(tensor, byte offset, bytes), ...]  ->   look the object up
                                                 <-   HELD and those bytes in order,
                                                      or FREED, or ALTERED (the request's
                                                      digest of the tensors' sizes is
                                                      not the object's)

Bytes land straight in the caller's `into=` buffers (else in warm reused memory).
Cancelling a fetch shuts its connections down: every thread reading into its buffers
returns, and only then does the cancel complete, so nothing writes them afterwards; the
connections are dropped (the next fetch connects anew). A send in flight keeps the
tensors it reads until it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import _io
from .._errors import ObjectFreedError, PeerDiedError, RDTError, TransferError
from . import _net, _segments
from ._base import (
    NO_STORE,
    Channel,
    Cost,
    Keeper,
    TransferInfo,
    Transport,
    Unreachable,
)
from ._kit import (
    GREETING_BYTES,
    another_listener,
    delivered,
    greeting,
    int_setting,
    landing_buffers,
    sizes_digest,
)

MAGIC = b"RDT1"
GREETING = b"RDT-TCP-GREETING"  # what the listener's first bytes prove, keyed with its token (`_greeting`)
HELD, FREED, ALTERED = b"\x01", b"\x02", b"\x03"
STREAM_MIN_BYTES = 4 << 20  # a stream for each this many bytes, up to `_streams()`
LANDED_STEP = 8 << 20  # a stream tells `TransferInfo.landed` of its bytes in steps of this many
PACKED_BYTES = 64 << 10  # answers up to this size leave in one send
CONNECT_S = 10.0  # connecting and the token's arrival (a consumer's: RDT_TCP_CONNECT_S)
CONNECT_STEP_S = 0.05  # how often a connect looks whether its fetch was cancelled
IDLE_CONNECTIONS = 16  # kept per producer, for reuse
IDLE_S = 60.0  # an idle connection is closed after this long unused
USER_TIMEOUT_S = 30.0  # bytes sent and unacknowledged this long: the peer is gone


def _stall_s() -> int:
    return int_setting("RDT_TCP_STALL_S", 120, 1, "the seconds a fetch waits for the producer's next byte (1 or more)")


def _connect_s() -> float:
    """How long a consumer's connect, and then the listener's greeting, may take: a
    firewall that drops the port answers nothing, and `auto` falls back only after this."""
    if not os.environ.get("RDT_TCP_CONNECT_S", "").strip():
        return CONNECT_S
    return int_setting("RDT_TCP_CONNECT_S", 10, 1, "the seconds a connect to a producer may take (1 or more)")


HOST_ENV = "RDT_TCP_HOST"
TOKEN_BYTES = 16
MAX_PARTS = 1 << 20  # byte ranges one request may ask for (a consumer asks one per tensor and stream)
_HEAD = struct.Struct("<HIq")  # obj_id length, number of parts, `sizes_digest` of the tensors' bytes
_PART = struct.Struct("<IQQ")  # tensor index, byte offset, byte count


def _streams() -> int:
    return int_setting("RDT_TCP_STREAMS", 4, 1, "the number of connections per fetch (1 or more)")


@dataclass(frozen=True)
class TcpMeta:
    """Where the producer listens, and the token its connections start with."""

    host: str
    port: int
    token: bytes


def check_meta(meta: object, obj_id: str) -> TcpMeta:
    """Return `meta` if it is a TcpMeta a producer could have made: an IP literal (never a
    name to resolve) a peer can connect to (`_net.not_a_peer`), a port in 1..65535, a
    token of the exact length.

    Runs on: consumer, before it connects anywhere. Raises: TransferError saying what is wrong.
    """
    why = None
    if not isinstance(meta, TcpMeta):
        why = f"not tcp metadata: {type(meta).__name__}"
    elif not _net.is_ip(meta.host):
        why = f"host {meta.host!r} is not an IP address"
    elif (no_peer := _net.not_a_peer(meta.host)) is not None:
        why = f"host {meta.host!r} is {no_peer}, where no producer listens"
    elif type(meta.port) is not int or not 1 <= meta.port <= 65535:
        why = f"port {meta.port!r} is not in 1..65535"
    elif type(meta.token) is not bytes or len(meta.token) != TOKEN_BYTES:
        why = f"the token is not {TOKEN_BYTES} bytes"
    if why is not None:
        raise TransferError(f"tcp fetch of {obj_id}: the ref's tcp metadata is malformed ({why}); nothing was read", obj_id=obj_id)
    return meta  # type: ignore[return-value]



def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data).cast("B")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the connection closed mid-message")
        got += n


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    opts = (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(USER_TIMEOUT_S * 1000)))
    for opt, value in opts:
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


# -- producer -----------------------------------------------------------------------------

# obj_id -> contiguous tensors, for the connection threads to serve. Written by the
# producer's threads (prepare, garbage_collect) with single dict operations.
_objects: dict[str, list[torch.Tensor]] = {}
_sized: dict[str, int] = {}  # obj_id -> `sizes_digest` of its tensors (what a request must name)


class _Server:
    """This process's listener: an accepting thread, and a thread per connection."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.sock, where = _net.tcp_listener(HOST_ENV, "transport 'tcp'")
        self.meta = TcpMeta(where.host, self.sock.getsockname()[1], self.token)
        self.pid = os.getpid()
        self.store: Keeper = NO_STORE  # the producer's, from the transport that listens
        threading.Thread(target=self._accept, name="rdt-tcp-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="rdt-tcp-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(CONNECT_S)
                conn.sendall(_greeting(self.token))  # first: a consumer sends nothing before it
                hello = _recv_exact(conn, len(MAGIC) + len(self.token))
                if hello[: len(MAGIC)] != MAGIC or not hmac.compare_digest(hello[len(MAGIC) :], self.token):
                    return  # not one of our consumers
                conn.settimeout(None)
                _tune(conn)
                while _answer(conn, self.store):
                    pass
            except OSError:
                return  # the consumer closed, cancelled or died


def _greeting(token: bytes) -> bytes:
    """The listener's first bytes (`_kit.greeting`: a line-based service a crafted ref named
    would read a command in a request's bytes)."""
    return greeting(token, GREETING)


def _answer(conn: socket.socket, store: Keeper) -> bool:
    """Serve one request on `conn`; False at the consumer's orderly close."""
    try:
        head = _recv_exact(conn, _HEAD.size)
    except ConnectionResetError:
        return False
    id_len, nparts, sized = _HEAD.unpack(head)
    if nparts > MAX_PARTS:
        raise ConnectionAbortedError(f"a request for {nparts} byte ranges")
    body = _recv_exact(conn, id_len + nparts * _PART.size)
    obj_id = body[:id_len].decode()
    parts = list(_PART.iter_unpack(body[id_len:]))
    with store.serving(obj_id, _objects) as tensors:  # held until sent: see Store.serving
        if tensors is None:
            conn.sendall(FREED)
            return True
        if sized != _sized.get(obj_id):
            conn.sendall(ALTERED)  # (a ref's specs that are not the object's: nothing of it is sent)
            return True
        return _send_parts(conn, obj_id, tensors, parts)


def _send_parts(conn: socket.socket, obj_id: str, tensors: list[torch.Tensor], parts: list[tuple[int, int, int]]) -> bool:
    raws: dict[int, memoryview] = {}  # of the tensors this stream asks for only: a stream asks for a quarter of 16,000
    views = []
    for i, off, n in parts:
        raw = raws.get(i)
        if raw is None and i < len(tensors):
            raw = raws[i] = _raw(tensors[i])
        if raw is None or off + n > raw.nbytes:
            raise ConnectionAbortedError(f"a request for bytes {off}..{off + n} of tensor {i} of {obj_id}")
        views.append(raw[off : off + n])
    # Small ranges leave joined, up to PACKED_BYTES a send (a send each was a system call
    # a tensor of a state dict of thousands); large ones as they are, without a copy.
    batch: list[memoryview | bytes] = [HELD]
    size = len(HELD)
    for v in views:
        if size and size + v.nbytes > PACKED_BYTES:
            conn.sendall(b"".join(batch) if len(batch) > 1 else batch[0])
            batch, size = [], 0
        if v.nbytes > PACKED_BYTES:
            conn.sendall(v)
        else:
            batch.append(v)
            size += v.nbytes
    if batch:
        conn.sendall(b"".join(batch) if len(batch) > 1 else batch[0])
    return True


_server: _Server | None = None
_server_lock = threading.Lock()


def _listening(store: Keeper | None = None) -> _Server:
    """This process's listener, serving from `store` from now on where given."""
    global _server
    with _server_lock:
        if _server is None or _server.pid != os.getpid():
            _server = _Server()
        if store is not None:
            _server.store = store
        return _server


# -- consumer -----------------------------------------------------------------------------

# (host, port, token) -> idle connections to that producer, each with when it went idle.
_idle: dict[tuple[str, int, bytes], list[tuple[socket.socket, float]]] = {}
_idle_lock = threading.Lock()


def _sweep(cutoff: float) -> float | None:  # on the I/O loop
    """Close the connections idle since `cutoff` or before; when the oldest left went idle."""
    old = []
    with _idle_lock:
        for key, pool in list(_idle.items()):
            old += [sock for sock, since in pool if since <= cutoff]
            pool[:] = [(sock, since) for sock, since in pool if since > cutoff]
            if not pool:
                del _idle[key]
        left = min((since for pool in _idle.values() for _, since in pool), default=None)
    for sock in old:
        sock.close()
    return left


_sweeper = _segments.IdleSweep(_sweep, lambda: IDLE_S)


def _connect(meta: TcpMeta, reuse: bool = True, fetch: _Fetch | None = None) -> tuple[socket.socket, bool]:
    """A connection to the producer, and whether it is a kept one (else new). `fetch`: the
    fetch it serves, which holds it from the start (`_Fetch.use`): a cancel ends the
    connect and the wait for the greeting at once (they take `_connect_s()` each at most)."""
    if reuse:
        with _idle_lock:
            pool = _idle.get((meta.host, meta.port, meta.token))
            if pool:
                sock = pool.pop()[0]  # the most recently used
                if fetch is not None:
                    fetch.use(sock)
                return sock, True
    within = _connect_s()
    sock = socket.socket(socket.AF_INET6 if ":" in meta.host else socket.AF_INET, socket.SOCK_STREAM)
    if fetch is not None:
        fetch.use(sock)
    try:
        try:
            _connect_within(sock, (meta.host, meta.port), fetch, within)
        except OSError as exc:  # not the caller's deadline: a transfer error (the core asks Ray about the producer)
            if isinstance(exc, TimeoutError):  # dropped, not refused: a firewall, most likely
                why = f"no answer in {within:g} s (RDT_TCP_CONNECT_S): a firewall drops that port, or no host has that address"
            else:
                why = f"{type(exc).__name__}: {exc}"
            raise Unreachable(
                f"cannot reach the producer's tcp listener at {_hostport(meta)} ({why}); where the producer runs, "
                f"{_net.settings_hint(HOST_ENV)}, or open that port (RDT_PORT_RANGE confines it)",
                lasting=not isinstance(exc, ConnectionRefusedError),  # (refused: the host answered)
            ) from exc
        sock.settimeout(within)
        _greeted(sock, meta, within)
        sock.sendall(MAGIC + meta.token)
        # A live producer sends its answer at once and its bytes without pause (a dead or
        # cut-off one is found by keepalive in ~30 s); a listener that says nothing (a ref's
        # address is input) must not hold a fetch for good.
        sock.settimeout(_stall_s())
        _tune(sock)
    except BaseException:
        if fetch is not None:
            fetch.release(sock)
        sock.close()
        raise
    return sock, False


def _connect_within(sock: socket.socket, address: tuple[str, int], fetch: _Fetch | None, within: float) -> None:
    """Connect within `within` s, looking every CONNECT_STEP_S whether `fetch` was cancelled
    (a blocking connect into a silent network cannot be cut short from another thread).
    Raises: TimeoutError, ConnectionAbortedError (cancelled), the connect's OSError."""
    sock.setblocking(False)
    err = sock.connect_ex(address)
    deadline = time.monotonic() + within
    while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
        if fetch is not None and fetch.cancelled:
            raise ConnectionAbortedError("the fetch was cancelled while it connected")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer to a connect in {within:g} s")
        _, writable, _ = select.select([], [sock], [], min(left, CONNECT_STEP_S))
        if writable:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            break
    if err:
        raise OSError(err, os.strerror(err))
    sock.setblocking(True)


def _greeted(sock: socket.socket, meta: TcpMeta, within: float) -> None:
    """Wait for the listener's greeting (`_greeting`); raise Unreachable where what listens
    at the ref's address is not the producer's listener, or says nothing in `within` s."""
    try:
        said = _recv_exact(sock, GREETING_BYTES)
    except (TimeoutError, ConnectionError) as exc:
        why = f"no greeting in {within:g} s" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise Unreachable(
            f"the listener at {_hostport(meta)} is not the producer's tcp listener ({why}); nothing was sent "
            f"to it. Where the producer runs, {_net.settings_hint(HOST_ENV)}"
        ) from exc
    if not hmac.compare_digest(said, _greeting(meta.token)):
        raise another_listener(_hostport(meta), "tcp")


def _hostport(meta: TcpMeta) -> str:
    return f"[{meta.host}]:{meta.port}" if ":" in meta.host else f"{meta.host}:{meta.port}"


def _keep(meta: TcpMeta, sock: socket.socket) -> None:
    with _idle_lock:
        pool = _idle.setdefault((meta.host, meta.port, meta.token), [])
        kept = len(pool) < IDLE_CONNECTIONS
        if kept:
            pool.append((sock, time.monotonic()))
    if kept:
        _sweeper.start()
    else:
        sock.close()


class _Fetch:
    """The connections of one fetch in flight, so that a cancel can shut them down."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.cancelled = False

    def use(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if not self.cancelled:
                return
        _shut(sock)

    def release(self, sock: socket.socket) -> bool:
        """Take `sock` back from the fetch; whether it may be reused (no cancel reached it)."""
        with self.lock:
            self.socks.remove(sock)
            return not self.cancelled

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            socks = list(self.socks)
        for sock in socks:
            _shut(sock)  # a blocked recv_into returns now


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


def _forget(meta: TcpMeta) -> None:
    """Close the idle connections to a producer one of them failed with."""
    with _idle_lock:
        pool = _idle.pop((meta.host, meta.port, meta.token), [])
    for sock, _ in pool:
        sock.close()


class _Stale(Exception):
    """A kept connection failed before any answer: its peer went while it was idle."""


Landed = Callable[[int, int, int], None] | None


def _stream(
    fetch: _Fetch,
    meta: TcpMeta,
    obj_id: str,
    sized: int,
    parts: list[tuple[int, int, int]],
    dsts: list[memoryview],
    landed: Landed = None,
) -> bool:
    """Fetch `parts` over one connection into `dsts` (blocking); False if the object is freed.
    `landed` (`TransferInfo.landed`) is told of each LANDED_STEP bytes once they are in.

    A kept connection found dead before any answer (the producer's end went while it was
    idle: a network blip since healed, keepalive) is replaced by a new one, once.
    """
    try:
        return _stream_once(fetch, meta, obj_id, sized, parts, dsts, landed, reuse=True)
    except _Stale:
        return _stream_once(fetch, meta, obj_id, sized, parts, dsts, landed, reuse=False)


def _stream_once(
    fetch: _Fetch,
    meta: TcpMeta,
    obj_id: str,
    sized: int,
    parts: list[tuple[int, int, int]],
    dsts: list[memoryview],
    landed: Landed,
    reuse: bool,
) -> bool:
    sock, reused = _connect(meta, reuse, fetch)
    ok = answered = False
    try:
        encoded = obj_id.encode()
        sock.sendall(_HEAD.pack(len(encoded), len(parts), sized) + encoded + b"".join(_PART.pack(*p) for p in parts))
        status = _recv_exact(sock, 1)
        answered = True
        if status == FREED:
            ok = True
            return False
        if status == ALTERED:
            ok = True
            raise TransferError(
                f"tcp fetch of {obj_id}: the producer's tensors are not of the sizes its ref's specs say "
                "(the ref was altered); nothing was read",
                obj_id=obj_id,
            )
        if status != HELD:
            raise ConnectionAbortedError(f"an answer that is no answer ({status!r})")
        for i, off, n in parts:
            if landed is None:
                _recv_into(sock, dsts[i][off : off + n])
                continue
            for at in range(off, off + n, LANDED_STEP):
                step = min(LANDED_STEP, off + n - at)
                _recv_into(sock, dsts[i][at : at + step])
                landed(i, at, step)
        ok = True
        return True
    except OSError as exc:
        if not fetch.cancelled:
            _forget(meta)  # the producer (or the path to it) failed: its other connections too
            if reused and not answered and not isinstance(exc, TimeoutError):
                raise _Stale from exc
            if isinstance(exc, TimeoutError):
                raise TransferError(
                    f"tcp fetch of {obj_id}: the producer's listener at {_hostport(meta)} sent nothing for "
                    f"{_stall_s()} s ({'mid-transfer' if answered else 'no answer to the request'}); "
                    "RDT_TCP_STALL_S sets how long a fetch waits",
                    obj_id=obj_id,
                ) from exc
        raise
    finally:
        if fetch.release(sock) and ok:
            _keep(meta, sock)
        else:
            sock.close()


def _plan(sizes: Sequence[int], streams: int) -> list[list[tuple[int, int, int]]]:
    """Split the tensors' bytes into up to `streams` contiguous ranges of (tensor, offset, bytes)."""
    total = sum(sizes)
    k = max(1, min(streams, total // STREAM_MIN_BYTES))
    share = -(-total // k)
    share += -share % 4096  # page-aligned ranges
    plans: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for i, size in enumerate(sizes):
        off = 0
        while off < size:
            if room == 0:
                plans.append([])
                room = share
            n = min(size - off, room)
            plans[-1].append((i, off, n))
            off, room = off + n, room - n
    return [p for p in plans if p] or [[]]


# A receive's streams block in recv_into: a pool of their own, never queued behind copies.
STREAMS = _io.declare("tcp-streams", 64)


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    return _io.pool(STREAMS)


class TcpTransport(Transport[TcpMeta]):
    """Plain TCP between any two processes that can reach each other (CPU tensors)."""

    name = "tcp"
    devices = ("cpu",)
    one_sided = True  # no Ray call: the request travels to the producer's listener
    fills_buffers = True  # straight into them; a cancel shuts the sockets first
    reports_landed = True  # each stream, every LANDED_STEP bytes
    auto_prepares = True  # auto's path to other nodes (streams in parallel)
    prepares_freely = True  # a listener, once; the object's tensors are served as they are
    auto_costs: ClassVar[Mapping[str, Cost]] = {"cpu/node": Cost(0.0042, 1.72), "cpu/hosts": Cost(0.0048, 1.52)}  # (transports/_auto.py)


    @classmethod
    def address(cls, meta: Any) -> str | None:
        """The listener's host: a connect there that got no answer (a firewall, no route)
        would cost every producer of that host its connect timeout, so `auto` leaves tcp out
        for all of them a while. A refused connect (the host answered: nothing listens on
        that port) or a listener of another token leaves nothing out (`Unreachable.lasting`):
        a stale or crafted ref naming a closed port takes tcp away from no live producer."""
        return _net.host_key(meta.host) if isinstance(meta, TcpMeta) else None

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        if isinstance(exc, ConnectionRefusedError):
            return PeerDiedError  # nothing listens there any more: the producer is gone
        if isinstance(exc, OSError):  # (Unreachable too: the core asks Ray whether the producer died)
            return TransferError  # the core asks Ray whether the producer died
        return None

    def warm_up(self) -> None:
        _threads()

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> TcpMeta:
        server = _listening(self.store)
        kept = _objects[obj_id] = [t.detach().contiguous() for t in tensors]
        _sized[obj_id] = sizes_digest(obj_id, [t.numel() * t.element_size() for t in kept])
        return server.meta

    def garbage_collect(self, obj_id: str, meta: TcpMeta) -> None:
        _objects.pop(obj_id, None)  # sends in flight keep their own references
        _sized.pop(obj_id, None)

    async def receive(
        self, info: TransferInfo[TcpMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        check_meta(info.meta, info.obj_id)
        mine = None if buffers is None else [b if b.device.type == "cpu" else None for b in buffers]
        dsts = landing_buffers(info.specs, mine)
        raws = [_raw(d) if d.numel() else memoryview(b"") for d in dsts]
        plans = _plan([r.nbytes for r in raws], _streams())
        fetch = _Fetch()
        pool = _threads()
        # Ranges are final where they land in the caller's buffers themselves.
        landed = info.landed if buffers is not None and all(d is b for d, b in zip(dsts, buffers)) else None
        sized = sizes_digest(info.obj_id, [r.nbytes for r in raws])  # (the producer's must be the same)
        submitted = [pool.submit(_stream, fetch, info.meta, info.obj_id, sized, p, raws, landed) for p in plans]
        streams = [asyncio.wrap_future(f) for f in submitted]
        try:
            await asyncio.wait(streams, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((f.exception() for f in streams if f.done() and f.exception()), None)
            if failed is not None:
                raise failed
        except BaseException:
            fetch.cancel()  # every stream ends now; none writes `dsts` after this returns
            for queued in submitted:
                queued.cancel()  # streams still queued behind other fetches' never start
            await _io.shielded(asyncio.wait(streams))
            for f in streams:
                if not f.cancelled():
                    f.exception()  # retrieved: the first failure is what the fetch raises
            raise
        if not all(f.result() for f in streams):
            raise ObjectFreedError(f"tcp fetch of {info.obj_id}: the producer no longer holds it", obj_id=info.obj_id)
        return delivered(buffers, dsts)
