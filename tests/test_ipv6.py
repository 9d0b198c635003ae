"""A Ray cluster whose node IPs are IPv6 ones, with no IPv4 between its hosts: tcp and
`auto` read exact values across them, and ucxx (IPv4 only) refuses, naming the fix.

The session's cluster (conftest.py) is IPv4 unless RDT_TEST_TOPOLOGY=split6, which runs
every cross-host test on IPv6 node IPs; this module checks the few paths that matter on
a small IPv6 cluster of its own in every run (tests/ipv6_cluster.py, in a process of its
own: this one may be a driver of the session's cluster already). That process is a bench's
two-host cluster (`ray_cluster`): once its checks are done, a SIGTERM ends it, and its hosts
must come down (one two-host cluster start for both)."""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

import rdt_async

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def seen():
    """What tests/ipv6_cluster.py saw; then its process is ended by SIGTERM, as `timeout` or a
    scheduler ends a bench, and what that left of its hosts (`exit`, `namespaces` before,
    `left` and `links` after)."""
    from rdt_async.bench._hosts import Hosts

    why = Hosts.unavailable()
    if why:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(rdt_async.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipv6_cluster.py")
    run = subprocess.Popen([sys.executable, script, "--then-wait"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, run.stdout), lines.put(None)], daemon=True).start()
    out: list[str] = []
    seen = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while seen is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the IPv6 cluster's checks did not end within {TIMEOUT_S} s:\n{_rest(run, out)[-4000:]}")
            if line is None:
                pytest.fail(f"the IPv6 cluster's process ended (exit {run.wait()}) before its checks did:\n"
                            f"{''.join(out)[-4000:]}")
            out.append(line)
            if line.startswith("{"):
                seen = json.loads(line)
        seen["namespaces"] = [n for n in _ip("netns", "list").split() if n.startswith(f"rdt{seen['hosts_key']}h")]
        run.terminate()
        seen["exit"] = run.wait(60)
    finally:
        if run.poll() is None:
            _rest(run, out)
    seen["left"], seen["links"] = _ip("netns", "list"), _ip("-br", "link")
    return seen


def _rest(run: subprocess.Popen[str], out: list[str]) -> str:
    """End the run (SIGTERM: its hosts come down, as a bench's do; then SIGKILL): all it said."""
    run.terminate()
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
    return "".join(out)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True).stdout


def test_tcp_and_auto_read_exact_values_both_ways_across_hosts_at_ipv6_node_ips(seen):
    head_ip, far_ip = seen["peer_ips"]
    assert sorted(seen["node_ips"]) == sorted([head_ip, far_ip]) and head_ip != far_ip
    assert all(ipaddress.ip_address(ip).version == 6 for ip in seen["node_ips"]), seen
    assert seen["tcp_hosts"] == [head_ip, far_ip]  # what each tcp listener advertises: its Ray node IP
    assert seen["far_reads_head"] == [[True, True], {"tcp": 2}], seen  # exact values, `auto` over tcp too
    assert seen["head_reads_far"] == [[True, True], {"tcp": 2}], seen


def test_ucxx_refuses_an_ipv6_node_ip_naming_the_fix(seen):
    if "ucxx" not in seen:
        pytest.skip("ucxx is not installed")
    assert seen["ucxx"] == (
        f"TransportUnavailableError: transport 'ucxx' cannot listen for {seen['peer_ips'][0]} (Ray's node IP): "
        "UCXX's listener binds IPv4 only (0.0.0.0); set RDT_UCXX_HOST to an IPv4 address of this host, or use tcp"
    )


def test_a_bench_cluster_ended_by_sigterm_takes_its_hosts_down(seen):
    """`timeout` or a scheduler ending a bench (SIGTERM) used to leave its network
    namespaces, links and Ray nodes behind: the hosts came down only through Ctrl-C. (The
    IPv6 cluster's process is such a bench's: `ray_cluster` of two hosts.)"""
    key = seen["hosts_key"]
    assert seen["namespaces"], "the host's namespace was not there to take down"
    assert seen["exit"] == 128 + 15
    # Its bridge rdt<key>d, hosts rdt<key>h<n> and their links (not another session's: rdt<key>5d)
    ours = re.compile(rf"^rdt{key}(d|h\d)", re.M)
    assert not ours.search(seen["left"]) and not ours.search(seen["links"]), (seen["left"], seen["links"])
