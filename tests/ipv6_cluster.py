"""A two-host Ray cluster whose node IPs are IPv6 ones (the bench's `split6` hosts: no IPv4
between them), run as a process of its own by test_ipv6.py (the test session's driver is
in another cluster already). Fetches across the hosts both ways and asks ucxx for an
object; prints one JSON line of what each saw. With `--then-wait` it then waits, hosts
up, for the SIGTERM that test_ipv6.py ends it with (as `timeout` or a scheduler ends a
bench): its hosts must come down."""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
import time

import ray
import torch

import rdt_async as rdt
from rdt_async.bench._hosts import ray_cluster

N = 1 << 20  # 8 MiB of int64: over auto's inline limit


def value(v: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.int64) * v


@rdt.remote
class Peer:
    @rdt.method(tensor_transport="tcp")
    def make_tcp(self, v: int):
        return {"w": value(v)}

    @rdt.method(tensor_transport="auto")
    def make_auto(self, v: int):
        return {"w": value(v)}

    @rdt.method(tensor_transport="ucxx")
    def make_ucxx(self, v: int):
        return {"w": value(v)}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def tcp_host(self) -> str:
        from rdt_async.transports import tcp

        return tcp._listening().meta.host

    async def read(self, refs, vs) -> tuple[list[bool], dict[str, int]]:
        """Whether each fetched value is exactly `value(v)`, and the paths the fetches took."""
        before = collections.Counter(rdt.store_stats()["fetches"])
        exact = [torch.equal((await rdt.fetch(r))["w"], value(v)) for r, v in zip(refs, vs)]
        return exact, dict(collections.Counter(rdt.store_stats()["fetches"]) - before)

    async def read_error(self, refs) -> str:
        try:
            await rdt.fetch(refs[0])
        except rdt.RDTError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"


def main() -> None:
    with ray_cluster(2, remote_resource="far", topology="split6") as hosts:
        head, far = Peer.remote(), Peer.options(num_cpus=0, resources={"far": 1}).remote()
        seen: dict[str, object] = {
            "node_ips": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
            "peer_ips": ray.get([head.node_ip.remote(), far.node_ip.remote()]),
            "far_reads_head": ray.get(far.read.remote([head.make_tcp.remote(1), head.make_auto.remote(2)], [1, 2])),
            "head_reads_far": ray.get(head.read.remote([far.make_tcp.remote(3), far.make_auto.remote(4)], [3, 4])),
            "tcp_hosts": ray.get([head.tcp_host.remote(), far.tcp_host.remote()]),
            "hosts_key": hosts._key,  # (the hosts' namespaces and links are named rdt<key>...)
        }
        if importlib.util.find_spec("ucxx") is not None:
            seen["ucxx"] = ray.get(far.read_error.remote([head.make_ucxx.remote(5)]))
        print(json.dumps(seen), flush=True)
        if "--then-wait" in sys.argv:
            time.sleep(300)


if __name__ == "__main__":
    main()
