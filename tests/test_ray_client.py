"""From a Ray Client driver (`ray.init("ray://head:10001")`, a notebook's): the driver is
no process of the cluster, so its own fetches and puts go through Ray's object store (or
the bytes in the ref), a direct transport asked for there is refused naming the fix, and
what it arranges between actors runs over every transport.

One client run serves the module (ray_client_driver.py, in a process of its own: a client
and a cluster driver cannot share one), against a client server on the session's cluster,
in a process of its own too (served from this one, it would register the client's actor
classes over this process's own). `--mode legacy`: the server is the driver of every
client, one process fewer to start than `ray start --head`'s proxy mode (a server per
client), which RDT_TEST_CLIENT_MODE=proxy runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_client_driver.py")
RUN_S = 120
MODE = os.environ.get("RDT_TEST_CLIENT_MODE", "legacy")


@pytest.fixture(scope="module")
def client(cluster):
    """What each step of ray_client_driver.py did, by step name."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said = tempfile.TemporaryFile("w+")  # the server's log (a pipe nobody reads would fill)
    server = subprocess.Popen(
        [sys.executable, "-m", "ray.util.client.server", "--address", cluster.address, "--host", "127.0.0.1",
         "--port", str(port), "--mode", MODE],
        stdout=said, stderr=subprocess.STDOUT, text=True,
    )
    try:
        run = subprocess.run(
            [sys.executable, DRIVER, f"ray://127.0.0.1:{port}"], capture_output=True, text=True, timeout=RUN_S
        )
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    said.seek(0)
    server_log = said.read()[-2000:]
    said.close()
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, (
        f"the client driver failed ({run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}\nserver:\n{server_log}"
    )
    return json.loads(lines[-1])


def test_the_client_fetches_through_the_object_store_with_exact_values(client):
    want = client["expected"]
    assert client["get_small"] == ["ok", want["2"]]  # its bytes came with the ref
    assert client["get_large"] == ["ok", want["3"]]
    assert client["fetch_big"] == ["ok", want["4"]]
    assert client["asked_object_store_small"] == ["ok", want["5"]]
    assert client["fetches"] == ["ok", {"inline": 2, "object_store": 2}]
    assert client["why"] == ["ok", "a Ray Client driver: only Ray's object store reaches it (through the client server)"]


def test_a_direct_transport_asked_for_in_the_client_is_refused_naming_the_fix(client):
    kind, name, message = client["asked_shm"]
    assert (kind, name) == ("error", "TransportUnavailableError")
    assert message.endswith(
        "this process is a Ray Client driver (ray.init('ray://...')), not a process of the cluster, so shm cannot "
        "reach it from the producer; ask for tensor_transport='object_store' (or 'auto', which takes it here), or "
        "fetch inside an actor, where every transport works"
    ), message
    assert client["put_shm"] == [
        "error", "TransportUnavailableError",
        "rdt.put(..., tensor_transport='shm') in a Ray Client driver (ray.init('ray://...')): shm would serve the "
        "tensors from this process, which is not a process of the cluster, so no consumer could reach it; put with "
        "tensor_transport='auto' or 'object_store' (the bytes go to Ray's object store now), or put inside an actor",
    ]


def test_the_clients_puts_reach_actors_and_itself(client):
    want = client["expected"]
    assert client["put_to_actor"] == ["ok", want["7"]]
    assert client["put_here"] == ["ok", want["7"]]
    assert client["wait_tensor_freed"] == ["ok", None]  # nothing of it is kept here: the store has its bytes


def test_what_the_client_arranges_between_actors_runs_over_the_cluster(client):
    want = client["expected"]
    assert client["actor_to_actor"] == ["ok", want["1"]]
    assert client["group"] == ["ok", want["9"]]  # a gloo group made from the client, fetched over
    assert client["free"] == ["ok", True]  # the producer freed it
    kind, name, message = client["after_free"]
    assert (kind, name) == ("error", "ObjectFreedError") and "was freed" in message, message
