"""Transfers show in Ray's metrics: read back from the Prometheus endpoint of the session's nodes."""

from __future__ import annotations

import os
import re
import time
import urllib.request

import pytest
import ray
import torch
from conftest import wait_until

import rdt_async as rdt
from rdt_async import _metrics
from rdt_async.transports import _net

pytestmark = pytest.mark.usefixtures("ray_session")

MIB = 1 << 20


@rdt.remote
class Reader:
    def worker_id(self) -> str:
        return ray.get_runtime_context().get_worker_id()

    async def read(self, refs) -> list[float]:
        return [float((await rdt.fetch(r))["w"].sum()) for r in refs]

    async def read_freed(self, refs) -> str:
        try:
            await rdt.fetch(refs[0])
        except rdt.ObjectFreedError as exc:
            return type(exc).__name__
        return "fetched"


def _scrape() -> str:
    """Every alive node's metrics endpoint, concatenated."""
    bodies = []
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            host = node["NodeManagerAddress"]
            if ":" in host:  # (split6) Ray's endpoint listens on IPv4 only (0.0.0.0): this host's, at loopback
                if _net.interface_of(host) is None:
                    continue
                host = "127.0.0.1"
            url = f"http://{host}:{node['MetricsExportPort']}/metrics"
            try:
                bodies.append(urllib.request.urlopen(url, timeout=5).read().decode())
            except OSError:
                pass  # an agent still starting: the next poll asks again
    return "\n".join(bodies)


def _samples(body: str, name: str, worker_id: str) -> dict[str, float]:
    """`name`'s samples of one worker, keyed by their other labels."""
    out = {}
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", body, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("WorkerId") == worker_id:
            key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k in ("transport", "error", "le", "publication", "publisher"))
            out[key] = float(m.group(2))
    return out


def _wait_for(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        body = _scrape()
        got = check(body)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"metrics did not show within {timeout} s; rdt lines seen:\n"
                        + "\n".join(line for line in body.splitlines() if "rdt_" in line)[:4000])
        time.sleep(1.0)


@pytest.fixture
def actors(sync_producer):
    """The session's producer (holding nothing of another test: its gauges count this one's
    objects only) and a reader of this test's."""
    wait_until(lambda: ray.get(sync_producer.stats.remote())["objects"] == 0, 10)
    reader = Reader.remote()
    yield sync_producer, reader
    ray.kill(reader)


def test_fetches_bytes_latency_errors_and_held_objects_show_in_rays_metrics_endpoint(actors):
    """What a Ray user sees in Prometheus or the dashboard after three fetches and a failed one."""
    producer, reader = actors
    consumer_id = ray.get(reader.worker_id.remote())
    producer_id = ray.get(producer.__ray_call__.remote(lambda self: ray.get_runtime_context().get_worker_id()))
    refs = [producer.make.remote(MIB // 4, seed=i) for i in range(3)]  # 1 MiB of float32 each
    want = [float(torch.randn(MIB // 4, generator=torch.Generator().manual_seed(i)).sum()) for i in range(3)]
    assert ray.get(reader.read.remote(refs)) == pytest.approx(want, rel=1e-5)
    freed = producer.make.remote(MIB // 4, seed=9)
    rdt.free(freed)
    wait_until(lambda: ray.get(producer.stats.remote())["objects"] == 3, 10)
    assert ray.get(reader.read_freed.remote([freed])) == "ObjectFreedError"
    transport = next(iter(ray.get(reader.__ray_call__.remote(lambda self: rdt.store_stats()["fetches"]))))

    def consumer_side(body: str):
        fetches = _samples(body, "ray_rdt_fetches_total", consumer_id)
        errors = _samples(body, "ray_rdt_fetch_errors_total", consumer_id)
        if fetches.get(f"transport={transport}") != 3 or not errors:
            return None  # not exported yet (Ray exports each second; the error came last)
        return (
            _samples(body, "ray_rdt_fetch_bytes_total", consumer_id),
            _samples(body, "ray_rdt_fetch_seconds_count", consumer_id),
            _samples(body, "ray_rdt_fetch_seconds_bucket", consumer_id),
            errors,
        )

    moved, counts, buckets, errors = _wait_for(consumer_side)
    assert moved == {f"transport={transport}": 3 * MIB}
    assert counts == {f"transport={transport}": 3}
    assert buckets[f"le=+Inf,transport={transport}"] == 3
    assert buckets[f"le=60.0,transport={transport}"] == 3  # each took under a minute
    assert errors == {f"error=ObjectFreedError,transport={transport}": 1}  # the producer's store had let it go

    def producer_side(body: str):
        held = _samples(body, "ray_rdt_objects_held", producer_id)
        return (held, _samples(body, "ray_rdt_bytes_held", producer_id)) if held.get("") == 3 else None

    _held, nbytes = _wait_for(producer_side)
    assert nbytes == {"": 3 * MIB}
    del refs  # the last refs go: the producer frees them, and the gauge says so
    _wait_for(lambda body: True if _samples(body, "ray_rdt_objects_held", producer_id).get("") == 0 else None)


def test_a_transport_name_this_process_does_not_know_is_tagged_other(monkeypatch):
    """A ref names its transport, unchecked (it came from another process): each value
    would be a series Ray keeps for the process's life."""
    records = []
    monkeypatch.setattr(_metrics, "_hand_off", lambda fn, *args: records.append(args))
    for name in ("shm", "relay", "local", "tenant-1-" + "x" * 20, "tenant-2"):
        _metrics.failed(name, ValueError("x"))
    _metrics.fetched("tenant-3", 1, 0.1)
    # Before: every name as it came, a new series each.
    assert [r[0] for r in records] == ["shm", "relay", "local", "other", "other", "other"]


def test_a_forked_child_s_records_are_flushed_and_the_queue_is_bounded(monkeypatch):
    """A forked child (a DataLoader worker that fetches) records on its own I/O loop."""
    flushed = []
    monkeypatch.setattr(_metrics, "_fetched", lambda *args: flushed.append(args))  # Ray's recording, stood in for
    _metrics.fetched("shm", 1, 0.1)  # queued here: a flush due on this process's loop
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            before = len(flushed)
            for _ in range(3):
                _metrics.fetched("shm", 1, 0.1)
            deadline = time.monotonic() + 5
            while _metrics._records and time.monotonic() < deadline:
                time.sleep(0.01)
            code = 0 if len(flushed) - before == 3 and not _metrics._records else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # before: 1, its records waiting for a flush due in its parent
    wait_until(lambda: not _metrics._records, 5)
    assert _metrics._records.maxlen == _metrics.MAX_RECORDS
