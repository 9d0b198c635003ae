"""`ucxx`: UCX tag transfers through UCXX, progressed by the I/O loop itself.

Each process has one UCX worker and, once it produces, one listener whose address and
a random 128-bit token travel in the `RDTObject`. A consumer keeps one endpoint per
producer, and sends nothing over it before the listener's first message, its greeting,
proves that it knows the ref's token (`_greeting`). An endpoint no fetch has used for
tcp's `IDLE_S` (60 s) is closed, and the greeting it proved forgotten: the next fetch
from that producer connects and checks the greeting anew. A transfer:

    consumer (I/O loop)                           producer (I/O loop)
    -------------------                           -------------------
    (first fetch over an endpoint only:)
    connect to the listener                  ->   accept; send the greeting
    wait for the greeting, check it against  <-   (an HMAC of its token)
    the ref's token
    post recv: status (tag T), and one per
    tensor (T+1+i) into its destination
    stream message {T, [i...], obj_id}       ->   look the object up
                                             <-   send status (T): held or freed
                                             <-   send each tensor (T+1+i); for a
                                                  freed object, empty messages

The request rides on UCX, not on a Ray call, and every receive is posted before it
goes: a fetch over an endpoint already greeted is one UCX round trip (the greeting it
proved is remembered with the endpoint), and large tensors (UCX's rendezvous protocol)
land straight in their destination. The first fetch over an endpoint waits for UCX to
connect and for the greeting first; RDT_UCXX_ANSWER_S bounds that wait and the answer's
together. A freed object still answers each posted receive (with nothing), because
UCXX cannot cancel one posted receive.

Progress: UCXX's own progress modes spin (its thread mode wakes every millisecond, its
asyncio modes keep a task runnable), so they are not used. The worker runs in blocking
mode: the I/O loop watches its epoll descriptor, progresses it on every event and arms
it again when idle, and polls every `POLL_S` only while requests are in flight. An idle
process (no request in flight, endpoints open or not) spends no CPU and no wake-up on
UCX: only an event wakes it, and an endpoint whose peer closed, died or (found by UCX's
TCP keepalive) vanished raises one.

Cancellation: UCXX's Python API cannot cancel one posted receive. The last fetch to
give up on an endpoint's greeting before it came closes the endpoint. A fetch whose
receives land in memory of its own (objects up to `PACKED_BYTES`, fetches without
`into=`) returns at once; its receives keep that memory until they end. One whose
receives write the caller's `into=` buffers returns once the bytes already asked for
have landed; a producer that has not answered within `DRAIN_S` gets its endpoint
closed, which cancels every receive posted on it (its other transfers fail too; the
next fetch reconnects). Either way nothing writes the caller's buffers after the
fetch returns. A transfer that fails on a live endpoint gives up the same way. An
endpoint that fails (its producer died) leaves UCXX's cancels of its receives to run:
the I/O loop runs them, and every request keeps its memory until UCX has ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib
import importlib.util
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _io
from .._errors import (
    BackendError,
    ObjectFreedError,
    PeerDiedError,
    RDTError,
    TransferError,
    TransportUnavailableError,
)
from . import _kit, _net, _segments, _ucx, tcp
from ._base import NO_STORE, Channel, Keeper, TransferInfo, Transport, Unreachable
from ._kit import another_listener, delivered, greeting, int_setting, landing_buffers, sizes_digest

INSTALL_HINT = "pip install 'rdt_async[ucxx]'"
POLL_S = 0.0005  # progress period while requests are in flight (events also progress)
DRAIN_S = 30.0  # the longest a cancelled fetch waits for its bytes in flight


_OPEN = "where the producer runs, set RDT_PORT_RANGE to ports the firewall admits (UCX listens there too)"
# UCX's TCP lanes also connect from the producer back to the consumer's UCX port.
_BACK = "UCX also connects from the producer back to this process: where a firewall guards this host, set RDT_PORT_RANGE here too"


class _Silent(TransferError):
    """No greeting and answer from the address a ref names within RDT_UCXX_ANSWER_S."""


def _silent(info: TransferInfo[UcxxMeta]) -> _Silent:
    return _Silent(
        f"ucxx fetch of {info.obj_id}: no answer from the producer at {info.meta.host}:{info.meta.port} in "
        f"{_answer_s()} s; RDT_UCXX_ANSWER_S sets how long a fetch waits (a firewall that drops the "
        f"producer's port answers nothing: {_OPEN}; {_BACK})",
        obj_id=info.obj_id,
    )


def _answer_s() -> int:
    return int_setting("RDT_UCXX_ANSWER_S", 120, 1, "the seconds a fetch waits for the producer's greeting and answer (1 or more)")
PROGRESS_STEPS = 64  # UCX progress calls per wake-up at most; more wait for the next poll
PACKED_BYTES = 64 << 10  # objects up to this size come with their status in one message
TAG_STRIDE = 1 << 20  # tags per transfer: status, then one per tensor
REQUEST_HEAD = 40  # a request's fixed part (`_pack`); its size says how many bytes follow
MAX_ID_BYTES = 0xFFFF  # a request's object id, encoded, at most (as tcp's)
HELD, FREED, ALTERED = 0, 1, 2  # ALTERED: the request's digest of the tensors' sizes is not the object's
HOST_ENV = "RDT_UCXX_HOST"
TOKEN_BYTES = 16
GREETING = b"RDT-UCXX-GREETING"  # what the listener's first message proves, keyed with its token


@functools.cache
def _import_reason() -> str | None:
    # Only look: loading ucxx's native library loads its UCX, which NIXL must not meet.
    try:
        spec = importlib.util.find_spec("ucxx")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"the ucxx package is not installed: {INSTALL_HINT}"
    return None


def _load() -> Any:
    """Load UCXX's native library (and its UCX) into this process, or say why not."""
    reason = _import_reason()
    if reason is not None:
        raise TransportUnavailableError(f"transport 'ucxx' is unavailable: {reason}")
    _ucx.claim("ucxx")
    ours = "UCX_MEMTYPE_CACHE" not in os.environ
    try:
        lib = importlib.import_module("ucxx._lib.libucxx")
    except Exception as exc:  # a broken install is a reason, not a crash
        raise TransportUnavailableError(
            f"transport 'ucxx' is unavailable: ucxx is installed but cannot be loaded "
            f"({type(exc).__name__}: {exc}); reinstall with {INSTALL_HINT}"
        ) from exc
    if ours:
        # Importing ucxx sets UCX_MEMTYPE_CACHE=n, which the UCX it ships no longer knows:
        # every process would print UCX's "unused environment variable" warning.
        os.environ.pop("UCX_MEMTYPE_CACHE", None)
    return lib


@dataclass(frozen=True)
class UcxxMeta:
    """Where the producer's listener is, and the token its greeting proves it knows."""

    host: str
    port: int
    token: bytes


def check_meta(meta: object, obj_id: str) -> UcxxMeta:
    """Return `meta` if it is a UcxxMeta a producer could have made: an IPv4 literal (never
    a name to resolve) a peer can connect to, a port in 1..65535, a token of the exact length.

    Runs on: consumer, before it connects anywhere. Raises: TransferError saying what is wrong.
    """
    why = None
    # (getattr: a UcxxMeta unpickled from an older version, or crafted, may lack a field)
    host, port, token = (getattr(meta, name, None) for name in ("host", "port", "token"))
    if not isinstance(meta, UcxxMeta):
        why = f"not ucxx metadata: {type(meta).__name__}"
    elif type(host) is not str or not _net.is_ip(host) or ":" in host:
        why = f"host {host!r} is not an IPv4 address"
    elif (no_peer := _net.not_a_peer(host)) is not None:
        why = f"host {host!r} is {no_peer}, where no producer listens"
    elif type(port) is not int or not 1 <= port <= 65535:
        why = f"port {port!r} is not in 1..65535"
    elif type(token) is not bytes or len(token) != TOKEN_BYTES:
        why = f"the token is not {TOKEN_BYTES} bytes"
    if why is not None:
        raise TransferError(f"ucxx fetch of {obj_id}: the ref's ucxx metadata is malformed ({why}); nothing was read", obj_id=obj_id)
    return meta  # type: ignore[return-value]


class _Peer:
    """A consumer's endpoint to one producer's listener."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.closed = False
        self.greeting: asyncio.Future[bytes] | None = None  # the listener's first message
        self.proven: bytes | None = None  # the token that greeting proves its listener knows
        self.using = 0  # fetches under way over it (the idle sweep closes none of these)
        self.since = 0.0  # when the last of them ended (time.monotonic())


class _Worker:
    """This process's UCX worker, listener, endpoints and requests in flight.

    Runs on: the I/O loop; every UCX call is made there (UCXX is used single-threaded).
    """

    def __init__(self) -> None:
        libucxx = _load()
        from ucxx._lib.arr import Array

        self.u, self.Array = libucxx, Array
        flags = (libucxx.Feature.TAG, libucxx.Feature.WAKEUP, libucxx.Feature.STREAM)
        self.context, self.worker = _context(libucxx, flags)
        self.worker.init_blocking_progress_mode()
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.worker.epoll_file_descriptor, self.progress)
        self.pending: list[tuple[Any, asyncio.Future[Any], Any]] = []  # transfers: polled
        self.listening: list[tuple[Any, asyncio.Future[Any], Any]] = []  # request waits: not
        self.orphans: list[tuple[Any, Any]] = []  # given up, writing our memory: kept
        self.timer: asyncio.TimerHandle | None = None
        self.listener: Any = None
        self.address: UcxxMeta | None = None
        self.token = secrets.token_bytes(TOKEN_BYTES)  # what this process's listener greets with
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.sweeper = _segments.IdleSweep(self._sweep, _idle_s)  # closes endpoints unused for tcp's IDLE_S
        self.served: set[Any] = set()  # endpoints accepted by the listener
        self.sending: set[asyncio.Future[Any]] = set()  # answers in flight (the loop keeps tasks weakly)
        self.store: Keeper = NO_STORE  # the producer's, from the transport that listens
        self.progress()

    # -- progress -------------------------------------------------------------

    def progress(self) -> None:
        """Progress the worker, settle finished requests, re-arm or re-poll."""
        # A bounded number of single steps: `worker.progress()` loops while UCX reports
        # work, which after an endpoint failure it can do for a long time.
        for _ in range(PROGRESS_STEPS):
            if not self.worker.progress_once():
                break
        # An endpoint that failed leaves the requests posted on it to be cancelled by a full
        # `worker.progress()` (never called here): cancel them now (~1 us when there are
        # none), so that UCX ends them. A receive no producer answers would end never.
        self.worker.cancel_inflight_requests(0, 1)
        for pending in (self.pending, self.listening):
            if pending:
                # A request leaves once UCX has ended it, never before: until then it may
                # write what it keeps. (Its future may be done already: given up.)
                pending[:] = [item for item in pending if not (item[0].completed and _settle(*item))]
        if self.orphans:  # their memory is free once UCX has ended them
            self.orphans[:] = [o for o in self.orphans if not o[0].completed]
        # Arm: the epoll descriptor then wakes us at the next event. Arming fails while
        # UCX has work left (events that came in meanwhile, a failed endpoint being torn
        # down): then poll again soon, never spin here. Transfers in flight (waits for
        # requests are none) are also polled, for progress that raises no event. Else
        # nothing wakes the process but an event: an endpoint that fails (its peer closed
        # or died; a vanished host is found by UCX's TCP keepalive) raises one.
        armed = self.worker.arm()
        if self.timer is None and (self.pending or not armed):
            self.timer = self.loop.call_later(POLL_S, self._tick)

    def _tick(self) -> None:
        self.timer = None
        self.progress()

    def wait(self, request: Any, keep: Any = None, *, listening: bool = False) -> asyncio.Future[Any]:
        """Return a future for a UCXX request; `keep` stays referenced until it finishes.

        A `listening` request (a producer waiting for the next request message) may wait
        forever: it is progressed by events only, never polled for. The caller calls
        `progress()` once it has posted what it posts in one go.
        """
        fut = self.loop.create_future()
        (self.listening if listening else self.pending).append((request, fut, keep))
        if self.timer is not None and self.timer.when() > self.loop.time() + POLL_S:
            self.timer.cancel()
            self.timer = None
        return fut

    def post(self, ep: Any, op: str, array: np.ndarray | None = None, tag: int | None = None) -> Any:
        """Post a send or receive on `ep`; refuse on an endpoint that failed.

        UCXX blocks for good when a request is posted on an endpoint whose error
        callback has run (it waits for a close that needs this thread's progress).
        Callbacks only run inside `progress()` on this thread, so this check holds.
        """
        if not ep.alive:
            raise self.u.UCXNotConnectedError("Endpoint is not connected")
        args = () if array is None else (self.Array(array),) if tag is None else (self.Array(array), self.u.UCXXTag(tag))
        return getattr(ep, op)(*args)

    # -- producer -------------------------------------------------------------

    def listen(self) -> UcxxMeta:
        """Open this process's request listener (once); return what its refs advertise.

        UCXX's listener binds a port on every IPv4 interface (0.0.0.0), not an address:
        what it advertises is `_net.address`'s (Ray's node IP unless set), IPv4 only.
        Raises: TransportUnavailableError (an IPv6 address; no free port in RDT_PORT_RANGE).
        """
        if self.address is None:
            where = _net.address(HOST_ENV)
            if where.family != socket.AF_INET:
                raise TransportUnavailableError(
                    f"transport 'ucxx' cannot listen for {where.host} ({where.source}): UCXX's listener binds "
                    f"IPv4 only (0.0.0.0); set {HOST_ENV} to an IPv4 address of this host, or use tcp"
                )
            self.listener = _net.in_range(self._listener, lambda e: isinstance(e, self.u.UCXBusyError), "transport 'ucxx'")
            self.address = UcxxMeta(where.host, int(self.listener.port), self.token)
        return self.address

    def _listener(self, port: int) -> Any:
        if port:  # in RDT_PORT_RANGE: skip ports taken (UCX logs an ERROR for each busy one it tries)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as UCX binds
                try:
                    probe.bind(("0.0.0.0", port))
                except OSError:
                    raise self.u.UCXBusyError(f"port {port} is taken") from None
        return self.u.UCXListener.create(self.worker, port, self._accept, deliver_endpoint=True)

    def _accept(self, ep: Any) -> None:  # inside progress(): only schedule
        self.served.add(ep)
        self.loop.call_soon(lambda: asyncio.ensure_future(self._serve(ep)))

    async def _serve(self, ep: Any) -> None:
        """Greet the consumer at `ep`, then answer its requests, read from the UCX stream
        (not active messages: UCXX files a posted active-message receive under the
        endpoint's handle and keeps it, and the endpoint with it, for good once the
        consumer has closed; a stream receive ends with its endpoint)."""
        try:
            greeting = np.frombuffer(_greeting(self.token), dtype=np.uint8)  # first: a consumer sends nothing before it
            self.wait(self.post(ep, "stream_send", greeting), greeting).add_done_callback(_retrieved)
            while True:
                head = await self._read(ep, REQUEST_HEAD)
                self._send(ep, head + await self._read(ep, _rest(head)))
        except ValueError:  # what is no request (no consumer of ours sent it): its stream is read no further
            ep.close_blocking()
            self.progress()
        except Exception:  # the consumer closed its endpoint or died: nothing to serve
            pass
        finally:
            self.served.discard(ep)

    async def _read(self, ep: Any, nbytes: int, *, listening: bool = True) -> bytes:
        """The next `nbytes` of `ep`'s stream (`listening`: waited for by events only, as a
        producer waits for requests, which may never come; else polled, `wait`)."""
        if not nbytes:
            return b""
        buf = np.empty(nbytes, dtype=np.uint8)
        fut = self.wait(self.post(ep, "stream_recv", buf), buf, listening=listening)
        self.progress()
        await fut
        return buf.tobytes()

    def _send(self, ep: Any, message: bytes) -> None:
        """Post the answer to a fetch request now; a task keeps it until it is sent, and
        the store holds the object until then (see Store.serving)."""
        base, posted, packed, sized, obj_id = _unpack(message)
        held = contextlib.ExitStack()
        try:
            tensors = held.enter_context(self.store.serving(obj_id, _objects))
            altered = tensors is not None and sized != _sized.get(obj_id)  # (a ref's specs that are not the object's)
            self._post_answer(ep, base, posted, packed, None if altered else tensors, held, ALTERED if altered else None)
        except BaseException:
            held.close()
            raise

    def _post_answer(
        self, ep: Any, base: int, posted: list[int], packed: bool, tensors: list[torch.Tensor] | None,
        held: contextlib.ExitStack, refusal: int | None = None,
    ) -> None:
        """Answer with the tensors, or with nothing where they are None: FREED, else `refusal`."""
        status = np.array([HELD if tensors is not None else refusal or FREED], dtype=np.uint64)
        sends: list[tuple[int, np.ndarray, torch.Tensor | None]]
        if packed:  # a small object: status and bytes in one message
            parts = [status.view(np.uint8)] + [_raw(t) for t in tensors or () if t.numel()]
            status, sends = np.concatenate(parts), []
        elif tensors is None:  # answer each posted receive, with nothing
            sends = [(i, _EMPTY, None) for i in posted]
        else:
            sends = [(i, _raw(t), t) for i, t in enumerate(tensors) if t.numel()]
        waits = []
        try:
            waits.append(self.wait(self.post(ep, "tag_send", status, base), status))
            for i, raw, t in sends:
                waits.append(self.wait(self.post(ep, "tag_send", raw, base + 1 + i), (t, raw)))
        except Exception:
            pass  # the consumer went away: nobody to send to
        self.progress()
        sending = asyncio.ensure_future(asyncio.gather(*waits, return_exceptions=True))  # a dead consumer fails them all
        self.sending.add(sending)
        sending.add_done_callback(self.sending.discard)
        sending.add_done_callback(lambda _: held.close())  # the store lets the tensors go

    # -- consumer -------------------------------------------------------------

    def peer(self, meta: UcxxMeta) -> _Peer:
        key = (meta.host, meta.port)
        peer = self.peers.get(key)
        if peer is None or peer.closed:
            ep = self.u.UCXEndpoint.create(self.worker, meta.host, meta.port, True)
            peer = self.peers[key] = _Peer(ep)
            ep.set_close_callback(self._closed, cb_args=(key, peer))
        return peer

    async def greeted(self, peer: _Peer, meta: UcxxMeta, deadline: float) -> bool:
        """Wait for the greeting of the listener `peer` connects to: True once it is the
        one `meta`'s token asks for, False if none came by `deadline` (loop time).

        Costs a comparison once a greeting proved the token. Raises: Unreachable where
        another greeting came (not this ref's producer).
        """
        if peer.proven is not None and hmac.compare_digest(peer.proven, meta.token):
            return True
        if peer.greeting is None:  # the first fetch over this endpoint asks; the others wait with it
            peer.greeting = asyncio.ensure_future(self._first_message(peer.ep))
            peer.greeting.add_done_callback(_retrieved)
        try:
            async with asyncio.timeout_at(deadline):
                said = await asyncio.shield(peer.greeting)
        except TimeoutError:
            return False
        if not hmac.compare_digest(said, _greeting(meta.token)):
            raise another_listener(f"{meta.host}:{meta.port}", "ucxx")
        peer.proven = meta.token
        return True

    async def _first_message(self, ep: Any) -> bytes:
        """The greeting `ep`'s listener sends first (a stream message, not an active one:
        UCXX files a posted active-message receive under the endpoint's handle and keeps it
        past the endpoint's close, where it takes the first message of the next endpoint
        that UCX makes at that address)."""
        return await self._read(ep, _kit.GREETING_BYTES, listening=False)

    def orphan(self, futs: set[asyncio.Future[Any]]) -> None:
        """Keep the requests of given-up waits, and the memory they write, until they end.

        For a transfer that gives up while its producer may still answer, and whose
        receives write only memory of its own: nothing is cancelled, nothing else fails.
        Orphans are progressed by events, never polled for; the idle sweep that closes
        their endpoint cancels those still posted.
        """
        given_up = [item for item in self.pending if item[1] in futs and not item[0].completed]
        self.pending[:] = [item for item in self.pending if item[1] not in futs]
        self.orphans += [(request, keep) for request, _, keep in given_up]

    def abandon(self, peer: _Peer) -> None:
        """Close `peer`'s endpoint now, cancelling every receive posted on it.

        For a transfer that gives up while its producer may still answer: once this
        returns, no receive it posted can write its buffers. Other transfers from that
        producer fail with it (the close callback fails them); the next fetch connects
        anew. A forced close does not wait for the peer.
        """
        if not peer.closed:
            peer.ep.close_blocking()  # calls `_closed`
            self.progress()  # the requests it cancelled settle their futures

    def release(self, peer: _Peer) -> None:
        """A fetch over `peer` ended: once no other uses it, it counts as idle from now; or,
        where the greeting it waited for has not come (the fetch was cancelled or its
        answer time passed), it is closed now (`abandon`, which cancels the greeting's
        receive): nothing is polled for a greeting no fetch waits for, and the next fetch
        connects and checks the greeting anew."""
        peer.using -= 1
        if not peer.using and peer.greeting is not None and not peer.greeting.done():
            self.abandon(peer)
        if not peer.using and not peer.closed:
            peer.since = time.monotonic()
            self.sweeper.start()

    def _sweep(self, cutoff: float) -> float | None:
        """Close the endpoints no fetch has used since `cutoff` or before (`IdleSweep`);
        return when the last use of the oldest left ended (None: none is left idle).

        A fetch under way holds its endpoint (`using`), so none is closed under it. What
        may still be posted on an idle one is no fetch's: receives of fetches that gave up
        (orphans, writing memory of their own; one for a greeting nobody waits for has
        closed its endpoint already: `release`). The close cancels them, and they keep
        their memory until UCX has ended them. The next fetch from that producer connects
        and checks the greeting anew. The producer's end fails with the close, ending its wait for requests.
        """
        idle = [peer for peer in self.peers.values() if not peer.using and not peer.closed]
        old = [peer for peer in idle if peer.since <= cutoff]
        for peer in old:
            peer.ep.close_blocking()  # calls `_closed`
        if old:
            self.progress()
        return min((peer.since for peer in idle if peer.since > cutoff), default=None)

    def _closed(self, key: tuple[str, int], peer: _Peer) -> None:  # inside progress() or abandon()
        peer.closed = True
        if self.peers.get(key) is peer:
            del self.peers[key]
        # Receives are matched by tag on the worker, not the endpoint: UCX never ends the
        # ones a dead producer was to answer. UCXX cancels those posted on this endpoint
        # (see `progress`); their futures fail then, and not before: until UCX has ended
        # a receive, it may write its buffer.


def _idle_s() -> float:
    """Seconds an unused endpoint is kept: tcp's for its idle connections (read at each sweep)."""
    return tcp.IDLE_S


def _context(libucxx: Any, flags: tuple[Any, ...]) -> tuple[Any, Any]:
    """Create the UCX context and worker: their network on the interface this transport
    advertises (`_ucx.settings`), and UCXX's own log at FATAL unless UCXX_LOG_LEVEL says.

    UCXX logs at ERROR, on stdout, each endpoint that fails with a status other than a
    reset: here, every producer that exits while a consumer holds an endpoint to it.
    The fetch raises PeerDiedError for it; a library's stdout belongs to the program.
    UCX and UCXX read their variables as the context is made, and the settings of UCX's
    transports (its TCP listeners' ports) as the worker opens them.
    """
    added = _ucx.settings(HOST_ENV)
    if "UCXX_LOG_LEVEL" not in os.environ:
        added["UCXX_LOG_LEVEL"] = "FATAL"
    with _ucx.environment(added):
        context = libucxx.UCXContext({}, feature_flags=flags)
        return context, libucxx.UCXWorker(context)


def _greeting(token: bytes) -> bytes:
    """The listener's first message (`_kit.greeting`)."""
    return greeting(token, GREETING)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Done callback of a future nobody may await (a greeting sent, or one every fetch gave
    up waiting for): its error (the peer went away) is moot."""
    if not fut.cancelled():
        fut.exception()


def _endpoint_error(peer: _Peer) -> Exception | None:
    """The error UCX closed `peer`'s endpoint with, or None."""
    try:
        peer.ep.raise_on_error()
    except Exception as exc:
        return exc
    return None


def _settle(request: Any, fut: asyncio.Future[Any], keep: Any) -> bool:
    """Complete `fut` from its finished request; return True (it leaves the pending list)."""
    if not fut.done():
        try:
            request.check_error()
        except Exception as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(request)
    return True


_EMPTY = np.empty(0, dtype=np.uint8)


def _pack(base: int, posted: list[int], packed: bool, sized: int, obj_id: str) -> np.ndarray:
    """A fetch request: its base tag, the tensor indexes it posted receives for (or, if
    `packed`, that it wants status and bytes in one message), the `sizes_digest` of the
    tensors' bytes its receives hold, the object. Its head (`REQUEST_HEAD` bytes) says
    how many bytes follow: a frame on the endpoint's stream."""
    encoded = obj_id.encode()
    head = np.array([base, len(posted), packed, len(encoded)], dtype=np.uint64).tobytes() + np.array([sized], dtype=np.int64).tobytes()
    return np.frombuffer(head + np.array(posted, dtype=np.uint32).tobytes() + encoded, dtype=np.uint8)


def _rest(head: bytes) -> int:
    """The bytes of a request that follow its head (`_pack`). A request comes from another
    process: its sizes are checked before anything is allocated for them.

    Raises: ValueError where the head asks for more tensors or a longer id than a consumer sends.
    """
    _, n, _, id_len = (int(x) for x in np.frombuffer(head[:32], dtype=np.uint64))
    if n > TAG_STRIDE - 2 or id_len > MAX_ID_BYTES:
        raise ValueError(f"a request for {n} tensors of an id of {id_len} bytes")
    return 4 * n + id_len


def _unpack(message: bytes) -> tuple[int, list[int], bool, int, str]:
    base, n, packed, _ = (int(x) for x in np.frombuffer(message[:32], dtype=np.uint64))
    sized = int(np.frombuffer(message[32:REQUEST_HEAD], dtype=np.int64)[0])
    posted = np.frombuffer(message[REQUEST_HEAD : REQUEST_HEAD + 4 * n], dtype=np.uint32).tolist()
    return base, posted, bool(packed), sized, message[REQUEST_HEAD + 4 * n :].decode()


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a NumPy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


# obj_id -> contiguous tensors, for the listener to serve. Written by the producer's
# threads (prepare, garbage_collect) with single dict operations; read on the I/O loop.
_objects: dict[str, list[torch.Tensor]] = {}
_sized: dict[str, int] = {}  # obj_id -> `sizes_digest` of its tensors (what a request must name)
_workers: dict[int, _Worker] = {}
_lock = threading.Lock()


async def _worker_async() -> _Worker:
    w = _workers.get(os.getpid())
    if w is None:
        # Loading UCX holds the GIL ~0.4 s (`_ucx.open_libraries`): its slow part first, in
        # a thread and without the GIL, so that neither loop of this process stands still.
        await _io.to_thread(_open_ucx, purpose=_io.CALLS)
        w = _workers.get(os.getpid())
        if w is None:
            w = _workers[os.getpid()] = _Worker()
    return w


@functools.cache
def _open_ucx() -> None:
    """Open the libucx wheel's `libucs` (the ~0.4 s of UCX's load; its other libraries take
    ~1 ms) ahead of ucxx's own loader, which then finds it open, once this process may load
    it (`_ucx.claim`). A system UCX is left to the loader."""
    if _import_reason() is not None or os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false":
        return
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    _ucx.claim("ucxx")
    _ucx.open_libraries([os.path.join(next(iter(spec.submodule_search_locations)), "lib", "libucs.so")])


def _worker_blocking() -> _Worker:
    """Return this process's worker from any thread, creating it on the I/O loop."""
    w = _workers.get(os.getpid())
    if w is not None:
        return w
    if _io.on_io_thread():
        raise RuntimeError("the ucxx worker must be created before use on the I/O loop")
    with _lock:
        return _io.start(_worker_async()).result()


class UcxxTransport(Transport[UcxxMeta]):
    """UCX tag send/recv between any two processes that can load ucxx (CPU tensors)."""

    name = "ucxx"
    devices = ("cpu",)
    one_sided = True  # no Ray call: the request travels over UCX to the producer's listener
    clashes_with = frozenset({"nixl"})  # (each brings its own UCX: see transports/_ucx.py)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _import_reason() or _ucx.conflict("ucxx")


    @classmethod
    def address(cls, meta: Any) -> str | None:
        return _net.host_key(meta.host) if isinstance(meta, UcxxMeta) else None  # (as tcp's)

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        lib = sys.modules.get("ucxx._lib.libucxx")  # loaded by whatever raised it
        if lib is None or not isinstance(exc, lib.UCXError):
            return None
        # The producer's endpoint reset or closed (its process or its host went away).
        gone = (lib.UCXConnectionResetError, lib.UCXNotConnectedError, lib.UCXEndpointTimeoutError)
        return PeerDiedError if isinstance(exc, gone) else BackendError

    def warm_up(self) -> None:
        _worker_blocking()

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> UcxxMeta:
        w = _worker_blocking()
        w.store = self.store
        address = _io.start(_listen(w)).result() if w.address is None else w.address
        kept = _objects[obj_id] = [t.detach().contiguous() for t in tensors]
        _sized[obj_id] = sizes_digest(obj_id, [t.numel() * t.element_size() for t in kept])
        return address

    def garbage_collect(self, obj_id: str, meta: UcxxMeta) -> None:
        _objects.pop(obj_id, None)  # sends in flight keep their own references
        _sized.pop(obj_id, None)

    async def receive(
        self, info: TransferInfo[UcxxMeta], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        check_meta(info.meta, info.obj_id)
        if len(info.specs) >= TAG_STRIDE - 1:
            raise ValueError(f"ucxx moves at most {TAG_STRIDE - 2} tensors per object")
        w = await _worker_async()
        dsts = landing_buffers(info.specs, buffers)
        # Large tensors land straight in the caller's contiguous buffers: a cancel must not
        # return while a receive may still write them. Else all lands in memory of ours.
        theirs = buffers is not None and any(d is b for d, b in zip(dsts, buffers)) and sum(s.nbytes for s in info.specs) > PACKED_BYTES
        transfer = asyncio.ensure_future(_transfer(w, info, dsts, theirs))
        try:
            await asyncio.wait({transfer})  # a cancel here leaves `transfer` running
        except asyncio.CancelledError:
            # Into the caller's memory: let what was asked for land, then give up; past
            # the bound, the transfer cancels its receives before it ends. Into ours:
            # give up now; the receives keep that memory until they end.
            if theirs:
                await _io.shielded(transfer, timeout=DRAIN_S)
            transfer.cancel()
            await _io.shielded(transfer)  # (errors retrieved: the caller cancelled, they are moot)
            raise
        transfer.result()
        return delivered(buffers, dsts)


async def _listen(w: _Worker) -> UcxxMeta:
    return w.listen()


async def _transfer(w: _Worker, info: TransferInfo[UcxxMeta], dsts: list[torch.Tensor], theirs: bool) -> None:
    """Ask the producer for the object and receive it into `dsts` (on the I/O loop).

    `theirs`: receives write the caller's buffers, so a transfer that gives up on a live
    producer cancels them (closing the endpoint); else they are left to end on their own.
    """
    meta = info.meta
    # Random: replies are matched by tag, not by sender, so a tag nobody can guess is
    # what keeps another process from answering in the producer's place.
    base = (secrets.randbits(43) | 1) * TAG_STRIDE
    raws = [_raw(d) for d in dsts]
    nbytes = sum(raw.nbytes for raw in raws)
    packed = nbytes <= PACKED_BYTES
    # Packed: status and bytes in one message, copied out. Else a receive per tensor.
    status = np.full(8 + (nbytes if packed else 0), 99, dtype=np.uint8)
    posted = [] if packed else [(i, raw, d) for i, (raw, d) in enumerate(zip(raws, dsts)) if raw.nbytes]
    request = _pack(base, [i for i, _, _ in posted], packed, sizes_digest(info.obj_id, [r.nbytes for r in raws]), info.obj_id)
    waits: list[asyncio.Future[Any]] = []
    # One answer time for the greeting (where it has not come yet) and the answer together.
    deadline = asyncio.get_running_loop().time() + _answer_s()
    peer = w.peer(meta)
    peer.using += 1  # released at the end (`_Worker.release`): the idle sweep leaves it open meanwhile
    try:
        if not await w.greeted(peer, meta, deadline):  # nothing goes to a listener before it proves it is the producer's
            raise _silent(info)
        try:
            waits.append(w.wait(w.post(peer.ep, "tag_recv", status, base), status))
            for i, raw, d in posted:
                waits.append(w.wait(w.post(peer.ep, "tag_recv", raw, base + 1 + i), (d, raw)))
            waits.append(w.wait(w.post(peer.ep, "stream_send", request), request))
        finally:
            w.progress()  # what was posted goes now, and is polled until it ends
        # A producer answers (the status) at once; an address that is no producer's (a
        # ref's fields are input: a listener that accepts and says nothing) must not hold
        # the fetch for good. Its bytes then take what they take (the watch ends a dead one).
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        if not waits[0].done() and not any(f.done() and not f.cancelled() and f.exception() for f in waits):
            raise _silent(info)
        await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        for error in [f.exception() for f in waits if f.done() and not f.cancelled()]:
            if error is not None:
                raise error
        said = int(status[:8].view(np.uint64)[0])
        if said == FREED:
            raise ObjectFreedError(f"ucxx fetch of {info.obj_id}: the producer no longer holds it", obj_id=info.obj_id)
        if said == ALTERED:
            raise TransferError(
                f"ucxx fetch of {info.obj_id}: the producer's tensors are not of the sizes its ref's specs say "
                "(the ref was altered); nothing was read",
                obj_id=info.obj_id,
            )
        if packed:
            off = 8
            for raw in raws:
                raw[:] = status[off : off + raw.nbytes]
                off += raw.nbytes
    except ObjectFreedError:
        raise
    except _Silent as exc:
        if waits:  # (no greeting yet: the last fetch to give up on it closes the endpoint, `release`)
            w.abandon(peer)  # no producer there (or none that answers): nothing it would send is awaited
        await _given_up(waits, theirs)
        raise TransferError(str(exc), obj_id=info.obj_id) from None
    except BaseException as exc:  # an error, or cancelled
        unfinished = any(not fut.done() for fut in waits)
        live = not peer.closed and peer.ep.alive
        if live and unfinished:
            if theirs:
                w.abandon(peer)  # a live producer may still answer: cancel what would land
            else:
                w.orphan(set(waits))  # the producer may still answer: into our memory
        await _given_up(waits, theirs)
        if not live and isinstance(exc, Exception):
            native = _endpoint_error(peer)
            if isinstance(native, w.u.UCXUnreachableError):
                # No answer to UCX's connect (a refused one, a dead producer, is "not
                # connected"): a firewall that drops the port, or no route. The core asks
                # Ray whether the producer died; `auto` takes another path if not.
                why = (f"ucxx fetch of {info.obj_id}: cannot reach the producer at {meta.host}:{meta.port} "
                       f"({type(native).__name__}: {native}): a firewall drops the port, or no route leads there; {_OPEN}")
                unreachable = Unreachable(why)
                unreachable.__cause__ = native
                raise TransferError(why, obj_id=info.obj_id) from unreachable
            if peer.proven is None and not isinstance(native, w.u.UCXNotConnectedError):  # (refused: nobody listens)
                # Failed before the listener greeted: its process died (the core asks Ray),
                # or UCX's connection back from the producer to our UCX port got no answer
                # (a firewall here: the producer gives that up, and the endpoint with it).
                why = (f"ucxx fetch of {info.obj_id}: UCX's connection with the producer at {meta.host}:{meta.port} "
                       f"failed before its greeting ({type(native or exc).__name__}: {native or exc}): it died, or a "
                       f"firewall drops UCX's connections; {_BACK}, to ports it admits, and {_OPEN}")
                unreachable = Unreachable(why)
                unreachable.__cause__ = native or exc
                raise TransferError(why, obj_id=info.obj_id) from unreachable
            raise PeerDiedError(
                f"ucxx fetch of {info.obj_id}: the producer at {meta.host}:{meta.port} died or closed "
                f"({type(exc).__name__}: {exc})",
                obj_id=info.obj_id,
            ) from exc
        raise
    finally:
        w.release(peer)


async def _given_up(waits: list[asyncio.Future[Any]], theirs: bool) -> None:
    """Let a given-up transfer's requests go: UCX ends them (their endpoint closed or
    failed, its receives are cancelled) and they keep their memory until then. Receives
    into the caller's buffers (`theirs`) are waited for: none writes them once the fetch
    has returned."""
    if theirs and waits:
        await _io.shielded(asyncio.wait(waits))  # (settled as UCX ends each: see `_Worker.progress`)
    for fut in waits:
        fut.cancel()
