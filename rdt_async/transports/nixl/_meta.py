"""What a producer hands its consumers in the RDTObject: everything a fetch needs, no round trip."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NixlMeta:
    """What a consumer needs to read an object: agent, metadata, addresses, liveness slot."""

    agent: str
    conn: bytes  # the producer agent's connection metadata (the same for all its objects)
    regs: tuple[bytes, ...]  # partial metadata of the object's registered regions, per memory type
    # Per tensor: (address, nbytes, device index, "DRAM" | "VRAM"), or None when empty.
    descs: tuple[tuple[int, int, int, str] | None, ...]
    slot: int  # address of the liveness slot (uint64) in the producer
    token: int
    pid: int
    host: str
