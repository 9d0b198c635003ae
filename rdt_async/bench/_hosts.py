"""Hosts on one machine: Ray nodes in network namespaces, each joined to this one by a veth pair.

A node started here is another host as far as Ray, rdt_async and UCX can tell: its own
network stack (one veth link to the head, which a test can take down), hostname, boot id
(UCX decides "same machine" by it, and would otherwise read over shared memory), its own
/dev/shm and its own Ray temp dir. It shares the process table, the file system and the
CPU with this host, so timings are a LAN with no wire limit, not a real network.

Two topologies (`TOPOLOGIES`):

- `flat`: each host's veth link is its default route, through the head (this namespace):
  every address of the head is reachable from every host, whichever one a process
  advertises. The head's node IP is the first link's near end.
- `split`: the hosts and the head share a "data network" (a bridge here, 10.<key>.0.0/24,
  the head at .1) that carries Ray's node IPs and is nobody's default route; the hosts
  have no default route at all. From a host only the data network's addresses are
  reachable: an address picked from the head's default route (its real network) is not
  (`Network is unreachable`), as on clusters whose node IPs sit on a second NIC, IPoIB,
  or a container or VPN network. Hosts reach each other on the bridge (no forwarding).
- `split6`: `split` over IPv6: the data network is fd00:<key>::/64 (the head at ::1), and
  the hosts have no IPv4 address but loopback's: Ray's node IPs, and every address a
  process advertises, must be IPv6 ones.

Needs root (namespaces, veth, mounts). `Hosts.unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

_PREFIX = "rdt"
TOPOLOGIES = ("flat", "split", "split6")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Hosts:
    """This namespace is the head host (`head_ip`); `add` starts a Ray node on a new host.

    `topology`: "flat", "split" or "split6" (see the module's docstring).
    """

    def __init__(self, topology: str = "flat") -> None:
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r}: give one of {', '.join(TOPOLOGIES)}")
        self.topology = topology
        self._claim = _free_key()  # 10.<key>.<n>.0/24 (fd00:<key>::/64) per host: concurrent sessions differ
        self._key = self._claim.key
        self._nodes: dict[str, _Node] = {}
        self._bridge: _Bridge | None = None
        if topology != "flat":
            net = f"10.{self._key}.0" if topology == "split" else f"fd00:{self._key}:"
            self._bridge = _Bridge(f"{_PREFIX}{self._key}d", net)
            self._bridge.create()
        try:
            self._first = self._link(1)
        except BaseException:
            if self._bridge is not None:
                self._bridge.delete()
            self._claim.release()
            raise
        self.head_ip = self._first.root_ip  # the first link's near end (split: the bridge's): every host reaches it

    @staticmethod
    def unavailable() -> str | None:
        """Why hosts cannot be made here, or None."""
        if not sys.platform.startswith("linux"):
            return "network namespaces are Linux only"
        if os.geteuid() != 0:
            return "making network namespaces needs root"
        for tool in ("ip", "unshare", "mount"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed"
        name = f"{_PREFIX}probe{os.getpid()}"
        try:
            _sh("ip", "netns", "add", name)
            _sh("ip", "netns", "del", name)
        except subprocess.CalledProcessError as e:
            return f"`ip netns add` failed: {e.stderr.strip()}"
        return None

    def _link(self, n: int) -> _Link:
        link = _Link(f"{_PREFIX}{self._key}h{n}", f"10.{self._key}.{n}", self._bridge, n)
        link.create()
        return link

    def add(self, name: str, gcs_address: str, resources: dict[str, float], env: dict[str, str] | None = None,
            timeout: float = 60.0, start_args: Sequence[str] = (),
            admit: Sequence[tuple[int, int]] | None = None) -> _Node:
        """Start a Ray node (no CPUs, `resources`) on a new host and wait until it has joined.

        `start_args`: more options for its `ray start`. `admit`: the host's firewall, set
        before Ray starts (`_Link.admit_only`): inbound TCP connections only to these
        port ranges (LOW, HIGH), the rest dropped."""
        import ray

        used = {n.link for n in self._nodes.values()}
        link = self._first if self._first not in used else self._link(max(int(k.name.rsplit("h", 1)[1]) for k in used) + 1)
        if admit is not None:
            try:
                link.admit_only(admit)
            except BaseException:
                if link is not self._first:
                    link.delete()
                raise
        node = _Node(name, link, gcs_address, resources, env or {}, start_args)
        self._nodes[name] = node
        deadline = time.monotonic() + timeout
        while not any(n["Alive"] and n["NodeManagerAddress"] == link.ns_ip for n in ray.nodes()):
            if node.proc.poll() is not None or time.monotonic() > deadline:
                out = node.output()
                self.remove(name)
                raise RuntimeError(f"the Ray node on host {name} ({link.ns_ip}) did not join: {out}")
            time.sleep(0.2)
        return node

    def node(self, name: str) -> _Node:
        return self._nodes[name]

    def nodes(self) -> list[_Node]:
        return list(self._nodes.values())

    def remove(self, name: str) -> None:
        node = self._nodes.pop(name)
        node.stop()
        if node.link is not self._first:
            node.link.delete()
        else:
            node.link.admit_only(None)  # (the first link stays, for the next node: without a firewall)

    def close(self) -> None:
        for name in list(self._nodes):
            self.remove(name)
        self._first.delete()
        if self._bridge is not None:
            self._bridge.delete()
        self._claim.release()


class _KeyClaim:
    """A network key held by this process: an exclusive flock on /run/rdt-hosts-KEY.lock.
    Sessions that start at once (pytest-xdist's workers) cannot take the same key, and a
    killed session's claim ends with its process. Released, the file goes too: removed
    while still locked, so a process that opened it before checks that what it locked is
    still the file at that path (it is not) and opens again."""

    def __init__(self, key: int, fd: int, path: str) -> None:
        self.key, self._fd, self._path = key, fd, path

    @classmethod
    def take(cls, key: int) -> _KeyClaim | None:
        path = f"/run/{_PREFIX}-hosts-{key}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return cls(key, fd, path)
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed it as we locked: lock the path's new file

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = -1


def _free_key() -> _KeyClaim:
    """A key no namespace of ours uses (another session's, or one a killed session left),
    claimed for this process."""
    for i in range(200):
        claim = _KeyClaim.take((os.getpid() + i) % 200 + 20)
        if claim is None:
            continue
        used = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
        if not any(name.startswith(f"{_PREFIX}{claim.key}h") for name in used):
            return claim
        claim.release()
    raise RuntimeError("no free network-namespace key: remove stale /run/netns/rdt* namespaces (`ip netns del`)")


class _Bridge:
    """The split topologies' data network: a bridge here, `ip` (`host(1)`) the head's
    address on it. `net`: `10.K.0` (a /24), or `fd00:K:` (a /64 of IPv6)."""

    def __init__(self, dev: str, net: str) -> None:
        self.dev, self.net = dev, net
        self.v6 = ":" in net
        self.ip = self.host(1)

    def host(self, n: int) -> str:
        """The address of the `n`th host on this network (1: the head)."""
        return f"{self.net}:{n:x}" if self.v6 else f"{self.net}.{n}"

    def addr(self, ip: str) -> tuple[str, ...]:
        """`ip addr add`'s arguments for `ip` on this network (IPv6: no duplicate address
        detection, which would hold the address back for a second or two)."""
        return (f"{ip}/64", "nodad") if self.v6 else (f"{ip}/24",)

    def create(self) -> None:
        _sh("ip", "link", "add", self.dev, "type", "bridge")
        try:
            _sh("ip", "addr", "add", *self.addr(self.ip), "dev", self.dev)
            _sh("ip", "link", "set", self.dev, "up")
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True)


class _Link:
    """Namespace `name` and a veth pair: `root_ip` here, `ns_ip` there.

    Flat: the pair is a /24 of its own (`net`) and the namespace's default route. Split
    (split6): the near end is a port of `bridge` (the head's address there is `root_ip`), the far
    end is host `n` on the bridge's network, and the namespace has no default route.
    """

    def __init__(self, name: str, net: str, bridge: _Bridge | None = None, n: int = 1) -> None:
        self.name, self.bridge = name, bridge
        if bridge is None:
            self.root_ip, self.ns_ip = f"{net}.1", f"{net}.2"
        else:
            self.root_ip, self.ns_ip = bridge.ip, bridge.host(n + 1)
        self.root_dev, self.ns_dev = f"{name}a", f"{name}b"

    def create(self) -> None:
        _sh("ip", "netns", "add", self.name)
        _sh("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", self.ns_dev)
        _sh("ip", "link", "set", self.ns_dev, "netns", self.name)
        if self.bridge is None:
            _sh("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.root_dev)
        else:
            _sh("ip", "link", "set", self.root_dev, "master", self.bridge.dev)
        _sh("ip", "link", "set", self.root_dev, "up")
        ns = ("ip", "netns", "exec", self.name)
        _sh(*ns, "ip", "addr", "add", *(self.bridge.addr(self.ns_ip) if self.bridge else (f"{self.ns_ip}/24",)),
            "dev", self.ns_dev)
        _sh(*ns, "ip", "link", "set", self.ns_dev, "up")
        _sh(*ns, "ip", "link", "set", "lo", "up")
        if self.bridge is None:
            _sh(*ns, "ip", "route", "add", "default", "via", self.root_ip)

    def admit_only(self, ranges: Sequence[tuple[int, int]] | None) -> None:
        """A firewall on this host (None: none): a new inbound TCP connection (a SYN
        arriving on the host's end of the link) is dropped, with no answer, unless its
        port is in one of `ranges`; established connections, the host's own outbound ones
        and their answers pass. Made of `tc` u32 filters on the link's ingress (no
        iptables needed); a dropped SYN is redirected to a veth that is down (kernels
        without tc's gact action have mirred). All of it goes with the namespace."""
        ns = ("ip", "netns", "exec", self.name)
        sink = "fwsink"
        subprocess.run([*ns, "tc", "qdisc", "del", "dev", self.ns_dev, "ingress"], capture_output=True)
        subprocess.run([*ns, "ip", "link", "del", sink], capture_output=True)
        if ranges is None:
            return
        _sh(*ns, "ip", "link", "add", sink, "type", "veth", "peer", "name", f"{sink}p")  # left down: drops
        _sh(*ns, "tc", "qdisc", "add", "dev", self.ns_dev, "ingress")
        tcp = ("parent", "ffff:", "protocol", "ip", "u32", "match", "ip", "protocol", "6", "0xff")
        for low, high in ranges:  # admitted: classified here, no later filter sees them
            for value, mask in _port_blocks(low, high):  # (the port at offset 22: an IP header of 20 bytes)
                _sh(*ns, "tc", "filter", "add", "dev", self.ns_dev, "prio", "1", *tcp,
                    "match", "ip", "dport", str(value), hex(mask), "classid", "1:1")
        # SYN set, ACK clear (the flags byte: offset 20 + 13): a new connection.
        _sh(*ns, "tc", "filter", "add", "dev", self.ns_dev, "prio", "9", *tcp,
            "match", "u8", "0x02", "0x12", "at", "33", "action", "mirred", "egress", "redirect", "dev", sink)

    def set_up(self, up: bool) -> None:
        """Take the link down (a partition) or bring it back."""
        _sh("ip", "link", "set", self.root_dev, "up" if up else "down")

    def pids(self) -> list[int]:
        """Processes in this namespace: all of them were started here, by `_Node`."""
        try:
            target = os.stat(f"/run/netns/{self.name}").st_ino
        except FileNotFoundError:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                        pids.append(int(entry))
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    pass
        return pids

    def delete(self) -> None:
        _signal(self.pids(), signal.SIGKILL)
        subprocess.run(["ip", "link", "del", self.root_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


_IN_HOST = """
set -e
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray
echo {boot_id} > /dev/shm/.boot_id && mount --bind /dev/shm/.boot_id /proc/sys/kernel/random/boot_id
hostname {hostname}
exec "$@"
"""


def _port_blocks(low: int, high: int) -> list[tuple[int, int]]:
    """Ports LOW..HIGH as aligned blocks (value, mask) a u32 match takes."""
    if not 0 < low <= high < 65536:
        raise ValueError(f"ports {low}-{high}: give 0 < LOW <= HIGH < 65536")
    blocks = []
    while low <= high:
        size = low & -low
        while low + size - 1 > high:
            size >>= 1
        blocks.append((low, 0xFFFF & ~(size - 1)))
        low += size
    return blocks


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


class _Node:
    """`ray start --block` on the far end of `link`, in its own mount and UTS namespaces."""

    def __init__(self, name: str, link: _Link, gcs_address: str, resources: dict[str, float], env: dict[str, str],
                 start_args: Sequence[str] = ()):
        self.name, self.link = name, link
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        script = _IN_HOST.format(boot_id=uuid.uuid4(), hostname=f"{_PREFIX}-{name}")
        self._log = open(f"/tmp/{link.name}-{name}.log", "w+")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", link.name, "unshare", "--mount", "--uts", "--propagation", "private",
             "sh", "-c", script, "sh", ray_cli, "start", f"--address={gcs_address}",
             f"--node-ip-address={link.ns_ip}", "--num-cpus=0", f"--resources={json.dumps(resources)}",
             "--disable-usage-stats", "--block", *start_args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True,
        )

    @property
    def ip(self) -> str:
        return self.link.ns_ip

    def raylet_pids(self) -> set[int]:
        return {pid for pid in self.link.pids() if _comm(pid) == "raylet"}

    def shm_dir(self) -> str:
        """This host's /dev/shm, seen from here (through a process in its mount namespace)."""
        return f"/proc/{self.proc.pid}/root/dev/shm"

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-4000:]

    def stop(self) -> None:
        """End every process of this host (all started here): SIGTERM, then SIGKILL after 3 s."""
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            _signal(self.link.pids() + ([self.proc.pid] if self.proc.poll() is None else []), sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (self.proc.poll() is None or self.link.pids()):
                time.sleep(0.05)
            if self.proc.poll() is not None and not self.link.pids():
                break
        self.proc.wait(5)
        self._log.close()
        try:
            os.unlink(self._log.name)
        except FileNotFoundError:
            pass


def _exit_on_sigterm() -> Any:
    """Have a SIGTERM (`timeout`, a job scheduler) end the run as Ctrl-C does, through the
    `finally` that takes the hosts down: not leaving namespaces, links and Ray nodes behind.
    Returns the handler it replaced (None off the main thread, where none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _exit)


def _default_object_store_bytes() -> int:
    """Ray's default for a node: 30% of memory, within what /dev/shm can hold."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else total
    return int(min(0.3 * total, 0.8 * shm))


@contextlib.contextmanager
def ray_cluster(hosts: int, remote_resource: str = "remote", topology: str = "flat") -> Iterator[Hosts | None]:
    """A Ray cluster for the bench: this host alone, or with others joined across veth links.

    With two hosts, actors asking for `remote_resource` run on the second host; with three,
    those asking for `remote_resource + "2"` on the third. `topology` is how the hosts are
    joined ("flat", "split" or "split6", see `Hosts`).
    """
    import ray

    if hosts == 1:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    why = Hosts.unavailable()
    if why:
        raise SystemExit(f"--hosts {topology if hosts == 2 else 'three'} needs network namespaces: {why}")
    from ray.cluster_utils import Cluster

    if topology != "flat":
        # The split rig's data network is a Linux bridge, whose address UCX's TCP leaves out
        # unless told: rdt_async tells it, the bench's raw nixl and ucxx paths do not. Set
        # before any node starts, so every process has it.
        os.environ["UCX_TCP_BRIDGE_ENABLE"] = "y"
    made = Hosts(topology)
    cluster = None
    previous = _exit_on_sigterm()
    try:
        # The object store a user's `ray start` gets, not Cluster's 150 MiB test default:
        # under that pressure Ray spills and runs gc.collect() in every worker, which
        # would slow the object-store paths the bench compares against.
        head = {"node_ip_address": made.head_ip, "include_dashboard": False,
                "object_store_memory": _default_object_store_bytes()}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        ray.init(address=cluster.address, log_to_driver=False)
        _exit_on_sigterm()  # again: Ray's driver sets a SIGTERM handler of its own (it aborts)
        made.add("remote", cluster.address, {remote_resource: 1000})
        if hosts >= 3:
            made.add("remote2", cluster.address, {remote_resource + "2": 1000})
        yield made
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        try:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
        finally:
            made.close()  # whatever Ray's shutdown raised: no namespace, link or node is left
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
