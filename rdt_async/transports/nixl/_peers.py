"""The producers a consumer reads from: one connection each, and the metadata loaded.

A producer's connection metadata is loaded once (cached per agent), each storage's
partial metadata once (a storage registered once on the producer gives the same blob
for every object over it).
"""

from __future__ import annotations

import collections
import threading

from ..._errors import PeerDiedError
from ._agent import Agent
from ._meta import NixlMeta

MD_CACHE = 4096  # partial metadata blobs remembered per producer (loaded once each)


class Peers:
    """Connections by producer agent, with epochs that tell one connection from the next.

    Connections are made and dropped on the I/O loop only; callers' threads only look
    them up. `_lock` guards the metadata loaded, which both change.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._remotes: dict[str, str] = {}  # producer agent -> name NIXL knows it by
        self._connects = 0  # connections made so far: `_epochs` tells them apart
        self._epochs: dict[str, int] = {}  # producer agent -> which connection `_remotes` holds
        self._lock = threading.Lock()
        self._loaded: dict[str, collections.OrderedDict[bytes, None]] = {}

    def remote(self, producer: str) -> str | None:
        """Return the name NIXL knows a connected producer by, or None."""
        return self._remotes.get(producer)

    def epoch(self, producer: str) -> int | None:
        """Return which connection to `producer` is the current one, or None."""
        return self._epochs.get(producer)

    async def connect(self, meta: NixlMeta) -> str:
        """Load the producer's metadata: its connection once, the object's regions each time.

        Runs on: consumer (I/O loop). Raises: PeerDiedError if the producer is unreachable.
        """
        agent = self._agent
        remote = self._remotes.get(meta.agent)
        if remote is None:
            try:
                name = await agent.call(agent.nixl.add_remote_agent, meta.conn, slow=True)
            except Exception as exc:
                raise PeerDiedError(
                    f"nixl: cannot connect to the producer's agent {meta.agent} (pid {meta.pid} on "
                    f"{meta.host}): it died or is unreachable ({type(exc).__name__}: {exc})"
                ) from exc
            remote = self._remotes[meta.agent] = name.decode() if isinstance(name, bytes) else name
            self._connects += 1
            self._epochs[meta.agent] = self._connects
        for md in self._unloaded(meta):
            await agent.call(agent.nixl.add_remote_agent, md)
            self._mark_loaded(meta.agent, md)
        return remote

    def load_now(self, meta: NixlMeta) -> None:
        """Load the object's regions not loaded yet, on this thread (the caller holds the agent)."""
        for md in self._unloaded(meta):
            self._agent.nixl.add_remote_agent(md)
            self._mark_loaded(meta.agent, md)

    async def forget(self, producer: str, epoch: int | None) -> None:
        """Drop the producer's connection `epoch` (None: whichever) and its metadata.

        Reads that broke on one connection each drop it: the first to do so may already
        have connected anew, and that connection stays.
        """
        if epoch is not None and self._epochs.get(producer) != epoch:
            return
        self._epochs.pop(producer, None)
        with self._lock:
            self._loaded.pop(producer, None)
        remote = self._remotes.pop(producer, None)
        if remote is not None:
            try:
                await self._agent.call(self._agent.nixl.remove_remote_agent, remote)
            except Exception:
                pass

    def _unloaded(self, meta: NixlMeta) -> list[bytes]:
        """Return the object's partial metadata blobs this agent has not loaded yet."""
        with self._lock:
            known = self._loaded.get(meta.agent)
            if known is None:
                return list(meta.regs)
            out = []
            for md in meta.regs:
                if md in known:
                    known.move_to_end(md)
                else:
                    out.append(md)
            return out

    def _mark_loaded(self, producer: str, md: bytes) -> None:
        with self._lock:
            known = self._loaded.setdefault(producer, collections.OrderedDict())
            known[md] = None
            while len(known) > MD_CACHE:
                known.popitem(last=False)  # forgetting only costs a reload
