"""`nixl`: one-sided READs with NVIDIA NIXL (UCX), CPU and CUDA tensors, any node.

One agent per process, made on first use, and the parts that hang off it, each in its
own module with its own lock where threads share it:

    _agent.py      loading nixl, the agent (progress thread, the lock the loop only tries)
    _memory.py     registrations: each storage once, refcounted
    _liveness.py   the producer's liveness slots, and the consumer's check of one
    _scratch.py    the consumer's bounce chunks and landing slots, registered once
    _peers.py      connections to producers, their metadata loaded; idle ones dropped
    _producer.py   the producer's objects: prepare, then release after a linger
    _poller.py     the producer's poll of its notifications, with backoff
    _plan.py       one fetch's READs: where they land, what is registered, in which order
    _xfer.py       one READ: posted from the I/O loop or on the caller's thread, awaited
    _transport.py  NixlTransport: the Transport interface over the parts

A fetch: the producer's `prepare` returns everything a consumer needs in the RDTObject
(no round trip to the producer); the consumer connects once per producer, READs the
tensors, then the object's liveness slot, which tells a freed object from a live one.
Importing this package does not import nixl.
"""

from __future__ import annotations

from ._meta import NixlMeta
from ._transport import NixlTransport

__all__ = ["NixlMeta", "NixlTransport"]
