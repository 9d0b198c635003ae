"""rdt_async: asyncio-native Ray Direct Transport.

Producers keep the tensors they return; consumers `await rdt.fetch(ref)` them over
shared memory, Ray's object store or another transport, without blocking their loop.
"""


from ._errors import BackendError as BackendError
from ._errors import CollectiveGroupError as CollectiveGroupError
from ._errors import ObjectFreedError as ObjectFreedError
from ._errors import PeerDiedError as PeerDiedError
from ._errors import RDTError as RDTError
from ._errors import TransferAbortedError as TransferAbortedError
from ._errors import TransferError as TransferError
from ._errors import TransportUnavailableError as TransportUnavailableError
from ._registered import MemoryRegistration as MemoryRegistration
from ._registered import register_memory as register_memory
from ._registered import register_memory_sync as register_memory_sync
from .transports._base import Channel as Channel
from .transports._base import Cost as Cost
from .transports._base import FetchRequest as FetchRequest
from .transports._base import TensorSpec as TensorSpec
from .transports._base import TransferInfo as TransferInfo
from .transports._base import Transport as Transport

try:  # the actor layer needs Ray; the transports alone run without it (a GPU box)
    from ._actor import method as method
    from ._actor import remote as remote
    from ._api import as_completed as as_completed
    from ._api import available_transports as available_transports
    from ._api import fetch as fetch
    from ._api import fetch_all as fetch_all
    from ._api import free as free
    from ._api import get as get
    from ._api import put as put
    from ._api import register_transport as register_transport
    from ._api import store_stats as store_stats
    from ._api import wait_tensor_freed as wait_tensor_freed
    from ._api import wait_tensor_freed_sync as wait_tensor_freed_sync
    from ._object import RDTObject as RDTObject
    from ._publish import Publisher as Publisher
    from ._publish import Subscription as Subscription
    from ._publish import VersionStream as VersionStream
    from ._publish import subscribe as subscribe
    from .collective import CollectiveGroup as CollectiveGroup
    from .collective import allgather as allgather
    from .collective import allgather_async as allgather_async
    from .collective import allreduce as allreduce
    from .collective import allreduce_async as allreduce_async
    from .collective import broadcast as broadcast
    from .collective import broadcast_async as broadcast_async
    from .collective import create_collective_group as create_collective_group
    from .collective import create_collective_group_async as create_collective_group_async
    from .collective import destroy_collective_group as destroy_collective_group
    from .collective import destroy_collective_group_async as destroy_collective_group_async
    from .collective import reduce_scatter as reduce_scatter
    from .collective import reduce_scatter_async as reduce_scatter_async
except ModuleNotFoundError as _exc:
    if _exc.name != "ray":
        raise
    _WITHOUT_RAY = f"{_exc}"

    def __getattr__(name: str) -> object:
        if name in __all__:
            raise ImportError(
                f"rdt_async.{name} needs Ray ({_WITHOUT_RAY}): pip install 'ray>=2.60,<3'"
            )
        raise AttributeError(f"module 'rdt_async' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [  # noqa: RUF022  (grouped by topic, as in the API reference)
    # actors
    "remote",
    "method",
    # verbs
    "fetch",
    "fetch_all",
    "as_completed",
    "get",
    "put",
    "free",
    "wait_tensor_freed",
    "wait_tensor_freed_sync",
    "store_stats",
    # versioned publishing
    "Publisher",
    "subscribe",
    "Subscription",
    "VersionStream",
    # transports
    "register_transport",
    "available_transports",
    "register_memory",
    "register_memory_sync",
    "MemoryRegistration",
    # collective groups
    "create_collective_group",
    "create_collective_group_async",
    "destroy_collective_group",
    "destroy_collective_group_async",
    "CollectiveGroup",
    # collectives over RDT objects
    "allreduce",
    "allreduce_async",
    "broadcast",
    "broadcast_async",
    "allgather",
    "allgather_async",
    "reduce_scatter",
    "reduce_scatter_async",
    # objects and transports
    "RDTObject",
    "Transport",
    "Channel",
    "FetchRequest",
    "TensorSpec",
    "TransferInfo",
    "Cost",
    # errors
    "RDTError",
    "TransportUnavailableError",
    "ObjectFreedError",
    "TransferError",
    "PeerDiedError",
    "TransferAbortedError",
    "BackendError",
    "CollectiveGroupError",
]

for _name in __all__:
    _obj = globals().get(_name)
    if getattr(_obj, "__module__", "").startswith("rdt_async."):
        try:
            _obj.__module__ = "rdt_async"
        except (AttributeError, TypeError):
            pass
del _name, _obj
