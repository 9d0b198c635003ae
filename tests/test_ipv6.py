"""A Ray cluster whose node IPs are IPv6 ones, with no IPv4 between its hosts: tcp and
`auto` read exact values across them, and ucxx (IPv4 only) refuses, naming the fix.

The session's cluster (conftest.py) is IPv4 unless RDT_TEST_TOPOLOGY=split6, which runs
every cross-host test on IPv6 node IPs; this module checks the few paths that matter on
a small IPv6 cluster of its own in every run (tests/ipv6_cluster.py, in a process of its
own: this one may be a driver of the session's cluster already)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

import rdt_async

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def seen():
    from rdt_async.bench._hosts import Hosts

    why = Hosts.unavailable()
    if why:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(rdt_async.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipv6_cluster.py")
    run = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = run.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.terminate()  # (SIGTERM: its hosts come down, as a bench's do)
        try:
            out, _ = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            out, _ = run.communicate()
        pytest.fail(f"the IPv6 cluster's checks did not end within {TIMEOUT_S} s:\n{out[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, out[-4000:]
    return json.loads(lines[-1])


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
