"""`nixl`: one-sided READs with NVIDIA NIXL (UCX), CPU and CUDA tensors, any node.

The transport lives in `_transport.py`. Importing this package does not import nixl.
"""

from __future__ import annotations

from ._transport import NixlMeta, NixlTransport

__all__ = ["NixlMeta", "NixlTransport"]
