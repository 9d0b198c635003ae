"""Collective groups: standalone Gloo/NCCL process groups over rdt.remote actors.

A group is made from the driver or any actor: its name is claimed in Ray's GCS (so a
name is unique in the cluster, and any process can read who holds which rank), the
members meet through the group's rendezvous keys in the GCS key-value store (behind
Ray's own authentication; no port is opened for it), and every member joins
concurrently through its `rdt` concurrency group, so members busy in user methods
still join.
Members keep their process group in the membership registry (`rdt_async._membership`);
transfers between members then go over it.

Declarative collectives (`allreduce`, `broadcast`, `allgather`, `reduce_scatter`) run
over RDT objects held by the members:

    caller (driver or any actor)                 each member (its `rdt` group, a thread)
    ------                                       ------
    resolve the refs, check holders, group,
    shapes and dtypes (no transfer: specs)
    send each member its part (a typed      ->   look the input up in the store, pack it
    message: Allreduce, Broadcast, ...)          (one buffer per dtype), run one collective
                                                 per dtype on the group's pg, wait for it,
    wait for every member                    <-  produce() the result here: an RDTObject
    return the calls' ObjectRefs: each one's value is the RDTObject its member produced,
    so the new refs are held by the members and fetched like any other.

A member that dies mid-collective breaks the group: the caller raises PeerDiedError
and marks the group broken in every survivor (aborting their process group, so that
none waits for the dead one). Collectives on one group issued by one process run one
at a time, in order; issuing collectives on one group from several processes at once
is not supported (as with torch.distributed, every member must see them in the same
order).

Where each part lives:

    _groups.py    create/destroy a group (caller)         _records.py  group names, rendezvous keys in the GCS
    _ops.py       allreduce and friends (caller)          _checks.py   the caller's checks
    _launch.py    send the parts, wait, break on failure  _messages.py what callers send
    _member.py    answer a message (member)               _kernels.py  the collectives on a pg
    _buffers.py   the member's reusable result buffers    _twins.py    blocking twins
"""

from ._buffers import BUFFERS_PER_SHAPE as BUFFERS_PER_SHAPE
from ._buffers import COLLECT_BYTES as COLLECT_BYTES
from ._checks import REDUCE_OPS as REDUCE_OPS
from ._groups import BACKENDS as BACKENDS
from ._groups import PING_TIMEOUT_S as PING_TIMEOUT_S
from ._groups import CollectiveGroup as CollectiveGroup
from ._groups import create_collective_group as create_collective_group
from ._groups import create_collective_group_async as create_collective_group_async
from ._groups import destroy_collective_group as destroy_collective_group
from ._groups import destroy_collective_group_async as destroy_collective_group_async
from ._launch import BREAK_GRACE_S as BREAK_GRACE_S
from ._member import serve as serve
from ._ops import allgather as allgather
from ._ops import allgather_async as allgather_async
from ._ops import allreduce as allreduce
from ._ops import allreduce_async as allreduce_async
from ._ops import broadcast as broadcast
from ._ops import broadcast_async as broadcast_async
from ._ops import reduce_scatter as reduce_scatter
from ._ops import reduce_scatter_async as reduce_scatter_async
from ._records import KV_NAMESPACE as KV_NAMESPACE

