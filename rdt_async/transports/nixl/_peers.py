"""The producers a consumer reads from: one connection each, and the metadata loaded.

A producer's connection metadata is loaded once (cached per agent), each storage's
partial metadata once (a storage registered once on the producer gives the same blob
for every object over it). A region NIXL holds that comes again with other metadata
(the producer registered that memory anew: over RDMA, another key) is not loaded over
the connection: NIXL 1.5.1 refuses it and then forgets the producer's regions and
connection details, though not its UCX connection, so that none can be made to it again
from this process. The connection is dropped and made anew first, once the other reads
using it have ended (`QUIET_S` at most: they are read again over the fresh one). (A ref
whose own blobs disagree on a region never gets here: `_check` refuses it.) A connection
is made anew alike once NIXL holds `REGIONS_MAX` regions of its producer and a read
brings more: the regions it holds are never forgotten otherwise.

Bounded: a consumer outliving many producers (actors that come and go) holds no entry
for each one it ever read from. A connection to a producer of this host whose process is
gone is dropped (its remote agent removed from NIXL) within `SWEEP_S` of going idle; one
to a producer of any host that a fetch found dead (`lost`, from the core) goes as soon as
no read uses it; past `MAX_PEERS` connections, the least recently used idle one goes at
once (the next read from it reconnects). A live producer's connection is otherwise kept: NIXL 1.5's
`remove_remote_agent` closes a live peer's UCX endpoints without freeing them (they go
with the worker: ai-dynamo/nixl#2025), so dropping and remaking connections to the same
live producers would leak what keeping them holds once. A dead peer's endpoints are
force-closed, and freed.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable

from ..._errors import TransferAbortedError, TransferError
from .._base import Unreachable
from .._kit import int_setting
from .._segments import IdleSweep
from ._agent import Agent
from ._check import Region, parse_blob
from ._meta import NixlMeta

MD_CACHE = 4096  # partial metadata blobs remembered per producer (loaded once each)
# Regions of a producer NIXL may hold (here: ~250 bytes each, and NIXL's own) before a
# read that brings more connects anew: one that registers new memory every step would
# otherwise grow both for the connection's life.
REGIONS_MAX = 1 << 16
# How often idle connections to this host's producers are checked for a producer gone (read at each sweep).
SWEEP_S = 10.0
# Connections kept at most; beyond, the least recently used idle one is dropped at once.
MAX_PEERS = int_setting("RDT_NIXL_MAX_PEERS", 256, 1, "a connection count, at least 1")
# The longest a read that must connect anew (its producer registered memory anew) waits
# for the other reads using the connection to end; the reads it then cuts off are read again.
QUIET_S = 5.0


class Peers:
    """Connections by producer agent, with epochs that tell one connection from the next.

    Connections are made and dropped on the I/O loop only; callers' threads only look
    them up. `_lock` guards the metadata loaded and the idle times, which both change.
    """

    def __init__(self, agent: Agent, gone: Callable[[NixlMeta], bool | None]) -> None:
        """`gone(meta)`: whether the producer's process is gone; None where this process
        cannot tell (another host's)."""
        self._agent = agent
        self._gone = gone
        self._metas: dict[str, NixlMeta] = {}  # producer -> the metadata it was last connected with
        self._remotes: dict[str, str] = {}  # producer agent -> name NIXL knows it by
        self._connects = 0  # connections made so far: `_epochs` tells them apart
        self._epochs: dict[str, int] = {}  # producer agent -> which connection `_remotes` holds
        self._lock = threading.Lock()
        self._loaded: dict[str, collections.OrderedDict[bytes, None]] = {}
        # producer -> each region NIXL holds of it, and the backend metadata it came with
        # (it goes with the connection, as NIXL's own copy does)
        self._regions: dict[str, dict[Region, bytes]] = {}
        self._busy: collections.Counter[str] = collections.Counter()  # producer -> reads using it now
        self._quieting: collections.Counter[str] = collections.Counter()  # producer -> reads of those in `_quiet`
        self._calm: dict[str, asyncio.Event] = {}  # producer -> set when one of its reads ends (or quiets)
        self._idle: dict[str, float] = {}  # producer -> when its last read ended (not while one runs)
        self._removing: dict[str, asyncio.Task[None]] = {}  # producer -> its remote agent's removal
        self._nodes: dict[str, str] = {}  # producer agent -> its Ray node, as the core names it (its pid: `_metas`)
        self._doomed: set[str] = set()  # producers declared gone while reads used them (`lost`)
        self._sweeper = IdleSweep(self._sweep, lambda: SWEEP_S)

    def __len__(self) -> int:
        """Return how many producers this agent holds a connection to."""
        return len(self._remotes)

    def hold(self, producer: str) -> None:
        """A read from `producer` begins: its connection is not dropped until `release`.

        Runs on: consumer (I/O loop), as `connect`.
        """
        self._busy[producer] += 1
        with self._lock:
            self._idle.pop(producer, None)

    def release(self, producer: str) -> None:
        """A read from `producer` ended (however): its connection may go idle (or go, if
        the producer was declared gone meanwhile), and the least recently used idle ones
        go past MAX_PEERS."""
        self._busy[producer] -= 1
        self._wake(producer)
        if self._busy[producer] <= 0:
            del self._busy[producer]
            if producer in self._doomed:
                self._drop(producer)
            elif producer in self._remotes:
                with self._lock:
                    self._idle[producer] = time.monotonic()
                self._sweeper.start()
        if len(self._remotes) > MAX_PEERS:
            self._shed(over=MAX_PEERS)

    def lost(self, node: str, pid: int) -> None:
        """The core learned that producer process `pid` of Ray node `node` is gone (a fetch
        from it ended in PeerDiedError): drop its connection now, or once the reads using it
        end. Runs on: consumer (I/O loop)."""
        for producer in [p for p, at in self._nodes.items() if at == node and self._metas[p].pid == pid]:
            if self._busy.get(producer):
                self._doomed.add(producer)
            else:
                self._drop(producer)

    def doomed(self, producer: str) -> bool:
        """Say whether `producer` was declared gone while reads used its connection (`lost`)."""
        return producer in self._doomed

    def touch(self, producer: str) -> None:
        """A read on the caller's thread used the connection (`receive_nowait`): it is not idle."""
        with self._lock:
            if producer in self._idle:
                self._idle[producer] = time.monotonic()

    def remote(self, producer: str) -> str | None:
        """Return the name NIXL knows a connected producer by, or None."""
        return self._remotes.get(producer)

    def epoch(self, producer: str) -> int | None:
        """Return which connection to `producer` is the current one, or None."""
        return self._epochs.get(producer)

    async def connect(self, meta: NixlMeta, node: str | None = None) -> str:
        """Load the producer's metadata: its connection once, the object's regions each time
        (`node`: the producer's Ray node, as the core knows it, for `lost`).

        Runs on: consumer (I/O loop), for a read that `hold`s the producer.
        Raises: TransferError (from `Unreachable`) if the producer cannot be reached: it
        died, or a firewall drops the connection.
        """
        agent = self._agent
        unloaded = self._unloaded(meta)
        if unloaded is None or self._crowded(meta.agent, unloaded):  # (None: a region registered anew)
            epoch = self._epochs.get(meta.agent)
            await self._quiet(meta.agent)
            unloaded = self._unloaded(meta)
            if unloaded is None or self._crowded(meta.agent, unloaded):
                await self.forget(meta.agent, epoch)  # (not a connection another read made meanwhile)
        remote = self._remotes.get(meta.agent)
        if remote is None:
            removing = self._removing.get(meta.agent)
            if removing is not None:  # its last connection's removal first: NIXL knows one entry a name
                await asyncio.shield(removing)
            remote = self._remotes.get(meta.agent)
        if remote is None:
            try:
                name = await agent.call(agent.nixl.add_remote_agent, meta.conn, slow=True)
            except Exception as exc:
                # Dead, or alive behind a firewall that drops UCX's connection (UCX's port
                # outside what it admits): the core asks Ray which (PeerDiedError if dead),
                # and `auto` takes another path for a live one (see `Unreachable`).
                why = (f"nixl: cannot connect to the producer's agent {meta.agent} (pid {meta.pid} on {meta.host}) "
                       f"({type(exc).__name__}: {exc}): it died, or a firewall drops UCX's connection to it; where "
                       "the producer runs, set RDT_PORT_RANGE to ports the firewall admits (UCX listens there)")
                unreachable = Unreachable(why)
                unreachable.__cause__ = exc
                raise TransferError(why) from unreachable
            remote = self._remotes[meta.agent] = name.decode() if isinstance(name, bytes) else name
            self._hold_regions(meta.agent, meta.conn)  # (its liveness table 0)
            self._metas[meta.agent] = meta
            if node is not None:
                self._nodes[meta.agent] = node
            self._connects += 1
            self._epochs[meta.agent] = self._connects
            if meta.agent not in self._busy:  # (connected outside a read: idle from now)
                with self._lock:
                    self._idle[meta.agent] = time.monotonic()
                self._sweeper.start()
            self._shed(over=MAX_PEERS)
        unloaded = self._unloaded(meta)
        if unloaded is None:  # (another read loaded other metadata of its regions meanwhile)
            raise TransferAbortedError(
                f"nixl: the producer {meta.agent} registered a region anew while it was read; read it again"
            )
        for md in unloaded:
            await agent.call(agent.nixl.add_remote_agent, md)
            self._mark_loaded(meta.agent, md)
        return remote

    def load_now(self, meta: NixlMeta) -> bool:
        """Load the object's regions not loaded yet, on this thread (the caller holds the
        agent); False where the connection is to be made anew first (`connect` does)."""
        unloaded = self._unloaded(meta)
        if unloaded is None or self._crowded(meta.agent, unloaded):
            return False
        for md in unloaded:
            self._agent.nixl.add_remote_agent(md)
            self._mark_loaded(meta.agent, md)
        return True

    async def forget(self, producer: str, epoch: int | None) -> None:
        """Drop the producer's connection `epoch` (None: whichever) and its metadata.

        Reads that broke on one connection each drop it: the first to do so may already
        have connected anew, and that connection stays.
        """
        if epoch is not None and self._epochs.get(producer) != epoch:
            return
        self._drop(producer)
        removing = self._removing.get(producer)
        if removing is not None:
            await asyncio.shield(removing)

    async def _quiet(self, producer: str) -> None:
        """Wait until every read using `producer`'s connection is one waiting here (the
        caller's among them), `QUIET_S` at most: the connection is about to be dropped."""
        self._quieting[producer] += 1
        self._wake(producer)  # (reads waiting here may go now)
        try:
            async with asyncio.timeout(QUIET_S):
                while self._busy.get(producer, 0) > self._quieting[producer]:
                    await self._calm.setdefault(producer, asyncio.Event()).wait()
        except TimeoutError:
            pass  # the reads still running are cut off, and read again
        finally:
            self._quieting[producer] -= 1
            if self._quieting[producer] <= 0:
                del self._quieting[producer]

    def _wake(self, producer: str) -> None:
        calm = self._calm.pop(producer, None)
        if calm is not None:
            calm.set()

    def _drop(self, producer: str) -> None:
        """Forget `producer`'s connection now, and remove its remote agent from NIXL next
        (a connect to it meanwhile waits for that). Runs on: consumer (I/O loop)."""
        self._epochs.pop(producer, None)
        self._metas.pop(producer, None)
        self._nodes.pop(producer, None)
        self._doomed.discard(producer)
        with self._lock:
            self._loaded.pop(producer, None)
            self._regions.pop(producer, None)
            self._idle.pop(producer, None)
        remote = self._remotes.pop(producer, None)
        if remote is not None and producer not in self._removing:
            task = asyncio.get_running_loop().create_task(self._remove(producer, remote))
            self._removing[producer] = task

    async def _remove(self, producer: str, remote: str) -> None:
        try:
            await self._agent.call(self._agent.nixl.remove_remote_agent, remote)
        except Exception:
            pass  # gone already, or the agent is shutting down: nothing to tell anyone
        finally:
            del self._removing[producer]

    def _sweep(self, cutoff: float) -> float | None:  # on the I/O loop
        """Drop the idle connections to producers gone; return when to look again (None:
        no idle connection is to a producer this host can see go)."""
        with self._lock:
            idle = [p for p in self._idle if p not in self._busy]
        watched = False
        for producer in idle:
            meta = self._metas.get(producer)
            gone = True if meta is None else self._gone(meta)
            if gone:
                self._drop(producer)
            watched |= gone is False
        return time.monotonic() if watched else None

    def _shed(self, over: int) -> None:
        """Drop the least recently used idle connections while more than `over` are held."""
        with self._lock:
            idle = sorted(self._idle, key=self._idle.__getitem__)
        for producer in idle[: max(0, len(self._remotes) - over)]:
            self._drop(producer)

    def _crowded(self, producer: str, unloaded: list[bytes]) -> bool:
        """Whether metadata `unloaded` goes over a fresh connection: REGIONS_MAX of the
        producer's regions are held already."""
        return bool(unloaded) and len(self._regions.get(producer, ())) >= REGIONS_MAX

    def _unloaded(self, meta: NixlMeta) -> list[bytes] | None:
        """Return the object's partial metadata blobs this agent has not loaded yet; None
        where one declares a region NIXL holds with other backend metadata.

        (The ref's blobs agree with each other: `_check` refused it otherwise.)"""
        with self._lock:
            known = self._loaded.get(meta.agent)
            held = self._regions.get(meta.agent, {})
            out = []
            for md in meta.regs:
                if known is not None and md in known:
                    known.move_to_end(md)
                    continue
                blob = parse_blob(md)
                for region, key in zip(blob.regions, blob.backend):
                    if held.get(region, key) != key:
                        return None
                out.append(md)
            return out

    def _hold_regions(self, producer: str, md: bytes) -> None:
        """Note the regions NIXL now holds of `producer`, loaded with blob `md`."""
        blob = parse_blob(md)
        with self._lock:
            self._regions.setdefault(producer, {}).update(zip(blob.regions, blob.backend))

    def _mark_loaded(self, producer: str, md: bytes) -> None:
        self._hold_regions(producer, md)
        with self._lock:
            known = self._loaded.setdefault(producer, collections.OrderedDict())
            known[md] = None
            while len(known) > MD_CACHE:
                known.popitem(last=False)  # forgetting only costs a reload
