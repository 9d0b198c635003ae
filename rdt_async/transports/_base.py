"""The transport interface: what a transport implements, and the awaitable FetchRequest."""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import torch

from .. import _io
from .._errors import RDTError, TransferAbortedError, TransferError, TransportUnavailableError

M = TypeVar("M")
GiB = 1 << 30


@dataclass(frozen=True)
class Cost:
    """What one fetch over a path costs: a fixed latency, then bytes at a bandwidth."""

    latency_s: float
    gib_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gib_s * GiB)


# When `auto` loads a transport in an `rdt.remote` actor at its creation (see
# `Transport.warm_at_creation`): always, never, or where auto may prepare objects for it.
WarmAt = Literal["always", "never", "where auto may take it"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of one tensor of an object, as the producer holds it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, "cpu" if t.is_cpu else str(t.device), t.numel() * t.element_size())

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}{list(self.shape)}@{self.device}"


# Bounds on what a ref may describe: torch's own limit on dimensions, and bytes no machine has.
MAX_DIMS = 64
MAX_SPEC_BYTES = 1 << 50
MAX_REACH = 1 << 62  # the bytes an empty spec's other dimensions span at most: its strides fit int64
# Dtypes no producer makes (a quantized tensor is refused at return): a tensor of one built
# from bytes has no quantizer, and torch crashes the process that reads it (a segfault).
QUANTIZED = frozenset(
    d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")) if d is not None
)


def check_specs(specs: Any, obj_id: str) -> None:
    """Refuse tensor specs that no producer makes: they came from another process.

    Runs on: consumer, before a fetch uses them (sizes buffers, checks `into=`, reads).
    Raises: TransferError naming the tensor and the field.
    """
    if type(specs) is not tuple:
        raise TransferError(f"object {obj_id}: its tensor specs are a {type(specs).__name__}, not a tuple", obj_id=obj_id)
    total = 0
    for i, s in enumerate(specs):
        total += _checked_nbytes(s, i, obj_id)
        if total > MAX_SPEC_BYTES:
            raise TransferError(f"object {obj_id}: its tensors claim over {MAX_SPEC_BYTES} bytes in all", obj_id=obj_id)


def _checked_nbytes(s: Any, i: int, obj_id: str) -> int:
    """`s.nbytes`, once `s` is a spec a producer makes (a plain check first: it costs ~1 µs)."""
    if type(s) is TensorSpec and type(s.shape) is tuple and len(s.shape) <= MAX_DIMS:
        numel = reach = 1
        for n in s.shape:
            if type(n) is not int or not 0 <= n <= MAX_SPEC_BYTES:  # (a dim of 2**63 beside a 0: no tensor has it)
                break
            numel *= n
            reach *= n or 1  # (an empty tensor's strides: they must fit torch's int64 too)
        else:
            dtype = s.dtype
            if (
                isinstance(dtype, torch.dtype)
                and dtype not in QUANTIZED
                and numel * dtype.itemsize <= MAX_SPEC_BYTES
                and reach * dtype.itemsize < MAX_REACH
                and type(s.nbytes) is int
                and s.nbytes == numel * dtype.itemsize
                and type(s.device) is str
                and _device_ok(s.device)
            ):
                return s.nbytes
    raise TransferError(f"object {obj_id}: tensor {i}'s spec is not one a producer makes: {_wrong(s)}", obj_id=obj_id)


def _wrong(s: Any) -> str:
    """What is wrong with a spec `_checked_nbytes` refused."""
    if type(s) is not TensorSpec:
        return f"a {type(s).__name__}, not a TensorSpec"
    shape, dtype = s.shape, s.dtype
    if type(shape) is not tuple or len(shape) > MAX_DIMS or not all(type(n) is int and 0 <= n <= MAX_SPEC_BYTES for n in shape):
        return f"shape {shape!r} (a tuple of at most {MAX_DIMS} ints from 0 to {MAX_SPEC_BYTES})"
    if not isinstance(dtype, torch.dtype):
        return f"dtype {dtype!r} (a torch.dtype)"
    if dtype in QUANTIZED:
        return f"dtype {dtype} (quantized: no producer sends one, and a tensor of it made from bytes crashes its reader)"
    holds = math.prod(shape) * dtype.itemsize
    if holds > MAX_SPEC_BYTES:
        return f"shape {list(shape)} of {dtype} ({holds} bytes, over {MAX_SPEC_BYTES})"
    if math.prod(n or 1 for n in shape) * dtype.itemsize >= MAX_REACH:
        return f"shape {list(shape)} of {dtype} (empty, but its other dimensions overflow a stride)"
    if type(s.nbytes) is not int or s.nbytes != holds:
        return f"nbytes {s.nbytes!r}, where shape {list(shape)} of {dtype} holds {holds}"
    return f"device {s.device!r} (a device string such as 'cpu' or 'cuda:0')"


@functools.lru_cache(maxsize=64)
def _device_ok(device: str) -> bool:
    if len(device) > 32:
        return False
    try:
        return str(torch.device(device)) == device
    except (RuntimeError, ValueError):
        return False


@dataclass(frozen=True)
class TransferInfo(Generic[M]):
    """What a consumer knows of an object before it moves: id, specs, the metadata."""

    obj_id: str
    specs: tuple[TensorSpec, ...]
    meta: M
    # The RDTObject itself, for transports that hand out views of the producer's memory:
    # a view keeps it (so its producer keeps the bytes and wait_tensor_freed waits).
    hold: Any = field(default=None, compare=False, repr=False)
    # The producer's process id on its node, as the core knows it from the ref's producer
    # (not from `meta`): transports that open the producer's files (shm, cuda_ipc) accept
    # only files that process made for this object. None where whoever drives the transport
    # made `meta` itself (a test, a benchmark): the pid `meta` names is taken as it stands.
    producer_pid: int | None = None
    # The Ray node id of the producer's node, as the core knows it from the ref (None as
    # above): with `producer_pid`, how `Transport.peer_gone` names a producer.
    producer_node: str | None = None
    # Where given, a transport that `reports_landed` calls it, from any thread, with
    # (tensor index, byte offset, byte count) each time a range of the receive's `buffers`
    # is final (this receive never writes it again): the node relay's other consumers copy
    # it into their own `into=` buffers while the rest still arrives. Cheap, never raises.
    landed: Callable[[int, int, int], None] | None = field(default=None, compare=False, repr=False)


class Channel(Protocol):
    """The consumer's line to the producer, handed to `Transport.receive`.

    Two-sided transports ask the producer's `send_multiple_tensors` through it. In a
    fetch between actors it is an actor call to the producer's `rdt` concurrency group;
    `rdt_async.testing.LoopbackChannel` is one to a producer in the same process.
    """

    async def request_send(self, request: Any) -> Any:
        """Ask the producer to run `send_multiple_tensors(..., request)`; return its reply."""
        ...


class NoChannel:
    """The channel of a fetch made outside the core (a benchmark's raw read): no producer to ask."""

    async def request_send(self, request: Any) -> Any:
        raise RuntimeError("this fetch has no line to its producer: only a one-sided transport can make it")


NO_CHANNEL = NoChannel()


class Keeper(Protocol):
    """The producer's store, as a transport that answers requests itself (a listener of its
    own: tcp, ucxx) serves from it.

    The core hands it to every transport it drives (`Transport.store`), as it hands
    `receive` a Channel; a transport never imports the core's store.
    """

    def serving(
        self, obj_id: str, kept: dict[str, list[torch.Tensor]]
    ) -> contextlib.AbstractContextManager[list[torch.Tensor] | None]:
        """Yield the tensors the transport `kept` for `obj_id`, the object held until the
        block ends (a free meanwhile waits for the send), or None if it was freed."""
        ...


class NoStore:
    """The store of a transport driven outside the core (a test, a benchmark): what the
    transport kept is served as it stands."""

    @contextlib.contextmanager
    def serving(self, obj_id: str, kept: dict[str, list[torch.Tensor]]) -> Iterator[list[torch.Tensor] | None]:
        yield kept.get(obj_id)


NO_STORE = NoStore()


class FetchRequest(_io.Started[list[torch.Tensor]]):
    """An in-flight fetch: await it for the tensors, cancel it to abort.

    The work runs on the process's I/O loop; awaiting the request from any loop never
    blocks that loop, and `result()` waits from plain threads. `wait()` (a loop) and
    `result()` (a thread) abort the transfer when the caller gives up (cancelled, timed
    out, interrupted) and return only once it has let go: a receive into the caller's
    buffers that cannot be interrupted lands first, so nothing writes them afterwards
    (at most `_io.SETTLE_S`: then the fetch claims the buffers until the receive ends).
    Errors are the transport's own: the core translates them (`_errors.translating`).
    """

    def __init__(self, transport: str, receive: Coroutine[Any, Any, list[torch.Tensor]]) -> None:
        super().__init__(receive)
        self.transport = transport

    @classmethod
    def start(
        cls,
        transport: Transport[M],
        info: TransferInfo[M],
        *,
        buffers: list[torch.Tensor] | None = None,
        channel: Channel = NO_CHANNEL,
    ) -> FetchRequest:
        """Start `transport.receive(info, buffers, channel)` on the I/O loop (on the caller's
        loop for a transport that `receives_on_caller_loop`, called from one); return at once.

        Runs on: consumer, any thread. This is how the core drives a transport, and how
        a test drives one without the core (`channel` may be left out for one-sided ones).
        """
        request = cls(transport.name, transport.receive(info, buffers, channel))
        request.launch(here=transport.receives_on_caller_loop)
        return request

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<FetchRequest {self.transport} {state}>"


class Transport(abc.ABC, Generic[M]):
    """A way to move an object's tensors from the producer's process to a consumer's.

    A subclass implements `receive`; every other method is an optional hook with a
    default. The lifecycle of one transfer, and the side that runs each step:

        producer                                   consumer
        --------                                   --------
        check_tensors(tensors)      at return
        prepare(obj_id, tensors) -> meta
              meta travels inside the RDTObject (through Ray)
                                                   check_meta(info)   before buffers on `device=`
                                                   receive_nowait(info, buffers) -> tensors | None
                                                   receive(info, buffers, channel) -> tensors
                                                       (on the I/O loop; cancelled on abort)
        [two-sided only, on request over the Channel]
        send_multiple_tensors(obj_id, tensors, meta, request) -> reply
        refuse(obj_id, request)        instead, once the object is gone
        garbage_collect(obj_id, meta)  on free()
        lends_memory(meta) -> bool     on free(): views read the tensors themselves? hold them
        recycle(obj_id, meta)          when the last ref (and view) is gone

    Either side, ahead of time (`registers_memory`; `rdt.register_memory`):
        register_memory(tensors) -> token   prepare and receive reuse what it made
        deregister_memory(token)            what objects still use stays until they end

    One-sided transports (shm) read without the producer; two-sided ones (object_store,
    gloo) need its `send_multiple_tensors`. Transports never import Ray: the channel to
    the producer is handed in, so the same transport runs between plain processes.
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    one_sided: ClassVar[bool] = True
    can_abort: ClassVar[bool] = True
    # What the core asks a transport, never its name (each a question with a default):
    # Where a consumer may be: "node" (a process of the producer's node: shared memory,
    # CUDA IPC, local files) or "cluster" (any process that reaches the producer). A fetch
    # from another node of a node-local object goes through the object store, `auto` takes
    # a node-local path on the producer's node only, and the node relay never relays one.
    reach: ClassVar[Literal["node", "cluster"]] = "cluster"
    # True if `prepare` puts the bytes themselves in the metadata (inline): the ref is a
    # snapshot, the producer keeps nothing, and `auto` takes it over every other path.
    carries_bytes: ClassVar[bool] = False
    # True if objects move over a collective group whose backend is the transport's name
    # (gloo, nccl): a producer in no such group is refused, a consumer outside the
    # producer's groups reads through the object store, and a consumer in one receives
    # the metadata `group_meta` makes (the producer's ref carries none).
    needs_group: ClassVar[bool] = False
    # True if `receive` lands the bytes straight in `buffers` when given, and a cancelled
    # receive returns at once and never writes them afterwards (tcp): the node relay's
    # first consumer then reads into the memory it hands the others, with no copy.
    fills_buffers: ClassVar[bool] = False
    # True if `receive` into `buffers` tells `TransferInfo.landed` of each range as it
    # becomes final (tcp, per stream every few MiB): the relay's first consumer then hands
    # the other consumers of its node each range as it lands, not the whole at the end.
    reports_landed: ClassVar[bool] = False
    # The producer's store, handed in by the core when it creates the transport (NO_STORE
    # where it is driven alone): a transport that serves requests itself serves from it.
    store: Keeper = NO_STORE
    # True if `receive` never blocks the loop that runs it (it queues device copies and
    # polls them: cuda_ipc): a fetch from a thread that runs an event loop runs it there,
    # not on the I/O loop, saving the hops there and back (~0.3 ms of a GPU fetch).
    receives_on_caller_loop: ClassVar[bool] = False
    # Bytes above which the producer prepares off the caller's loop.
    inline_prepare_bytes: ClassVar[int] = 1 << 20
    # True if `receive` writes into caller buffers on any of `devices`, whatever device
    # the producer's tensors are on (NIXL: CPU -> CUDA and back). Then
    # `fetch(device=...)` reads straight into that device instead of moving afterwards.
    cross_device_buffers: ClassVar[bool] = False
    # True if memory can be made ready for this transport ahead of time and kept so
    # (NIXL registers it with its agent): objects made of it and fetches into it then skip
    # that work. `rdt.register_memory` refuses transports that say False.
    registers_memory: ClassVar[bool] = False
    # Names of transports whose native libraries cannot load in one process beside this
    # one's (nixl and ucxx each bring their own UCX build): `rdt.remote` refuses, at
    # decoration, an actor class whose methods return over both.
    clashes_with: ClassVar[frozenset[str]] = frozenset()
    # -- what `auto` may do with it (transports/_auto.py) --
    # The cost of one fetch over it, by "<cpu|gpu>/<node|hosts>" (CPU or GPU tensors; a
    # consumer on the producer's node, or on another one), fitted to end-to-end passes by
    # `python -m rdt_async.bench --only e2e --write-costs FILE` (RDT_AUTO_COSTS=FILE lays
    # a file's over these). A consumer's `auto` takes, of the paths the producer prepared
    # (and a group both are in, and the object store), the one it expects to finish first;
    # a path with no cost for a place is not taken there.
    auto_costs: ClassVar[Mapping[str, Cost]] = {}
    # True if a producer's `auto` prepares objects for it unasked: for consumers on its
    # node, the cheapest such transport (by `auto_costs`) that exports here; on a cluster
    # of several nodes, also the cheapest that reaches other nodes, and every one that
    # `prepares_freely`. A `carries_bytes` one is prepared alone, where the object fits.
    auto_prepares: ClassVar[bool] = False
    # The object sizes (bytes, all its tensors) for which `auto` prepares it.
    auto_min_bytes: ClassVar[int] = 0
    auto_max_bytes: ClassVar[int | None] = None
    # True if preparing an object costs nothing per object (tcp: a listener made once, no
    # copy): `auto` prepares it for other nodes' consumers beside a cheaper path, as
    # their fallback before the object store.
    prepares_freely: ClassVar[bool] = False

    @classmethod
    def group_meta(cls, group: str, rank: int) -> M:
        """Return the metadata of a fetch over collective group `group` from the producer
        at `rank` in it (transports with `needs_group`: the consumer makes it, not the ref).

        Runs on: consumer, when it chooses the transport (cheap: no I/O).
        """
        raise NotImplementedError(f"transport {cls.name!r} moves no objects over a collective group")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Return why this transport cannot be used in this process, or None."""
        return None

    @classmethod
    def address(cls, meta: Any) -> str | None:
        """Return the address a consumer reaches the producer at for this object (its
        metadata, checked or not: never raise), or None: the producer's node.

        Runs on: consumer. Where this path could not reach the producer (`Unreachable`,
        lasting), `auto` leaves it out for a while for objects at the same address (None:
        every object of that node): a ref naming another address (a producer with its own
        RDT_TCP_HOST, or a crafted ref naming a closed port) takes it away from no other.
        Name the producer as finely as your metadata can: tcp and ucxx give the
        listener's `host:port`, nixl the producer's agent. Default None.
        """
        return None

    @classmethod
    def exports_here(cls) -> bool:
        """Say whether this process's tensors can be prepared (exported) for this transport.

        Runs on: producer, once per process, before `auto` plans an object over it.
        Default: whether the transport is available here (`unavailable_reason`).
        """
        return cls.unavailable_reason() is None

    @classmethod
    def warm_at_creation(cls) -> WarmAt:
        """Say when an `rdt.remote` actor loads this transport as it is created, before its
        loop serves anything (see `warm_up`), beside the transports its methods name.

        Runs on: an actor's process, at creation (cheap: no import of a native library).
        Default "never": for a transport whose first use is slow (NIXL's agent, ~0.5 s),
        say "where auto may take it" (a cluster of several nodes where it is a path of
        `auto` for this process's devices) or "always".
        """
        return "never"

    def warm_up(self) -> None:
        """Load native libraries and create this process's state now (blocking).

        Runs on: either side, on a thread that may block. Transports do this on first
        use anyway; call it where a first-use stall would hurt (UCXX holds the GIL for
        ~0.4 s while its libraries load).
        """

    def check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse tensors this transport cannot move, naming the fix.

        Runs on: producer, when the value is returned.
        Raises: TransportUnavailableError.
        """
        for t in tensors:
            if t.layout != torch.strided:
                raise TransportUnavailableError(
                    f"transport {self.name!r} moves dense tensors, not {t.layout}; "
                    "return t.to_dense() (or the sparse tensor's indices and values)"
                )
            if t.device.type not in self.devices:
                raise TransportUnavailableError(
                    f"transport {self.name!r} moves tensors on {', '.join(self.devices)}, "
                    f"not {t.device}; use tensor_transport='auto' or one that handles "
                    f"{t.device.type} tensors"
                )

    def prepare(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> M:
        """Make the tensors reachable (export, register) and return the metadata.

        Runs on: producer.
        """
        return None  # type: ignore[return-value]

    def prepare_lazily(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> M:
        """`prepare`, leaving costly work (a copy) to the first consumer that asks for it.

        Runs on: producer, where `auto` prepares the object for other nodes as well, from an
        actor that serves requests: most consumers may never take this path. Default: `prepare`.
        """
        return self.prepare(obj_id, tensors)

    def check_meta(self, info: TransferInfo[M]) -> None:
        """Refuse metadata `prepare` would not have made for `info.specs` (it came from
        another process), naming the field. `receive` still checks what it uses.

        Runs on: consumer, on the caller's thread, before the core allocates anything a
        ref sized (buffers on the fetch's `device`, for `cross_device_buffers`). Default: nothing.
        Raises: TransferError.
        """

    def receive_nowait(self, info: TransferInfo[M], buffers: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Return the tensors at once if that cannot block (tiny local copies), else None.

        Runs on: consumer, on the caller's thread. The default takes the I/O loop path.
        """
        return None

    @abc.abstractmethod
    async def receive(
        self, info: TransferInfo[M], buffers: list[torch.Tensor] | None, channel: Channel
    ) -> list[torch.Tensor]:
        """Do the consumer's side of the transfer: return the tensors of `info`, in order,
        written into `buffers` (the caller's `into=`) when given.

        Runs on: consumer, on rdt_async's I/O loop (`FetchRequest.start`; on the caller's
        loop where `receives_on_caller_loop`). Must release
        what it holds when cancelled. The one method every transport implements.
        """

    async def send_multiple_tensors(
        self, obj_id: str, tensors: Sequence[torch.Tensor], meta: M, request: Any
    ) -> Any:
        """Do the producer's side of a two-sided transfer; return the reply.

        Runs on: producer (its I/O loop).
        """
        raise NotImplementedError(f"transport {self.name!r} is one-sided")

    async def refuse(self, obj_id: str, request: Any) -> None:
        """The object is gone: release whatever the consumer posted for this request.

        Runs on: producer, before the consumer gets ObjectFreedError. Two-sided
        transports whose consumer posts receives first must complete them here.
        """

    def garbage_collect(self, obj_id: str, meta: M) -> None:
        """Release what `prepare` made for the object.

        Runs on: producer. Must be quick and must not raise for a second call.
        """

    def lends_memory(self, meta: M) -> bool:
        """Whether consumers' views of the object read the producer's own tensors (a mapping
        of its memory, not a copy): then after an explicit free the producer still holds
        them for `wait_tensor_freed` until the object's last ref, and with it every such
        view, is gone. Runs on: producer. Default: False.
        """
        return False

    def recycle(self, obj_id: str, meta: M) -> None:
        """Release what `prepare` made, once the object's last ref (and any view) is gone.

        Unlike after `garbage_collect` (an explicit free), nothing anywhere can still read
        what was prepared: a transport may reuse it. Runs on: producer. Default: garbage_collect.
        """
        self.garbage_collect(obj_id, meta)

    def peer_gone(self, node_id: str, pid: int) -> None:
        """The producer process `pid` of Ray node `node_id` (`TransferInfo.producer_node`,
        `producer_pid`) is gone: a fetch from it, over any transport, ended in PeerDiedError
        (Ray declared it dead, or it disconnected), or Ray declared it dead during a fetch,
        which is cancelled right after this call. Let go of what this process keeps for it
        (a connection, loaded metadata) instead of waiting to see it go, which a transport
        cannot for a process on another node; a cancel of what is in flight to it may then
        cut it off at once (nixl's READs, whose reply a partition holds up).

        Runs on: consumer, any thread (the fetch's). Must be quick. Default: nothing.
        """

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Make the memory of `tensors` ready for this transport until `deregister_memory`.

        Return a token for `deregister_memory`. Objects made of these tensors (or views of
        them) and fetches into them must reuse what this made. On an error, nothing stays.
        Runs on: either side, on a thread that may block (`rdt.register_memory` calls it off
        the event loop). Called only where `registers_memory` is True.
        """
        raise NotImplementedError(f"transport {self.name!r} registers no memory ahead of time")

    def deregister_memory(self, token: Any) -> None:
        """Undo one `register_memory`; memory that objects or fetches still use stays ready
        until they end. Runs on: either side. Quick: must not block or raise.
        """

    def memory_stats(self) -> dict[str, int]:
        """Return what this process has registered (counts and bytes), for `rdt.store_stats()`.

        Runs on: either side. Default: nothing (transports with `registers_memory` report).
        """
        return {}

    @classmethod
    def native_error(cls, exc: BaseException) -> type[RDTError] | None:
        """The rdt_async error that `exc`, raised by this transport's library, stands for.

        Runs on: consumer, when a fetch over this transport raised something that is not
        an rdt_async error; the core words the message (`rdt_async._errors.translate`).
        None (the default) makes it a BackendError. Decide by class where the library
        has classes (NIXL, UCXX); map a lost peer to PeerDiedError and a freed object
        to ObjectFreedError, which callers branch on.
        """
        return None


class Unreachable(ConnectionError):
    """Raised by `receive` where the producer cannot be reached at the address its metadata
    names (no route, refused, no answer to a connect), before anything was transferred; or
    raised as the cause of the error where nothing read from it ends (nixl's stalled READs).

    The core then takes another path where `auto` chose this one, or fails naming the
    address and the setting to change (the message says both).
    """

    says_its_cause = True  # its message repeats the native error: shown errors skip it (_errors.one_chain)

    def __init__(self, *args: object, lasting: bool = True) -> None:
        super().__init__(*args)
        # Whether the address stays unreachable a while: `auto` then leaves this path out
        # for objects at that address (`Transport.address`) for 5 minutes. False where
        # something answered there that is not this ref's producer (tcp's greeting of
        # another token: a stale or crafted ref): only this fetch takes another path.
        self.lasting = lasting


class StillWriting(TransferAbortedError):
    """Raised by `receive` where a transfer into the caller's buffers (`into=`) was cut off
    and the transport cannot rule out that it writes them still (a read its library would
    not end: nixl's READs whose producer is unreachable). The core neither reads again nor
    falls back into those buffers: bytes landing late would change a value it had returned.
    The message tells the caller to give the buffers up. (nixl also raises it for a later
    fetch into buffers such a read of a cancelled fetch lands in.)
    """
