"""The public surface: names, no import side effects, available transports."""

from __future__ import annotations

import inspect
import subprocess
import sys

import rdt_async as rdt

CONTRACT = {
    "remote", "method", "fetch", "fetch_all", "as_completed", "get", "put", "free",
    "wait_tensor_freed", "wait_tensor_freed_sync", "store_stats", "register_transport", "available_transports", "RDTObject", "Transport", "Channel",
    "FetchRequest", "RDTError", "TransportUnavailableError", "ObjectFreedError",
    "TransferError", "PeerDiedError", "TransferAbortedError", "BackendError",
    "CollectiveGroupError", "Publisher", "subscribe", "Subscription",
}


def test_all_matches_exports_and_covers_the_contract():
    # Subpackages become attributes once imported (the bench, by tests that time it).
    public = {n for n in dir(rdt) if not n.startswith("_") and not inspect.ismodule(getattr(rdt, n))}
    assert set(rdt.__all__) == public
    assert CONTRACT <= set(rdt.__all__)
    assert all(getattr(rdt, n).__module__ == "rdt_async" for n in rdt.__all__ if hasattr(getattr(rdt, n), "__module__"))


def test_error_tree():
    assert issubclass(rdt.PeerDiedError, rdt.TransferError)
    assert issubclass(rdt.TransferAbortedError, rdt.TransferError)
    assert issubclass(rdt.BackendError, rdt.TransferError)
    for e in (rdt.TransportUnavailableError, rdt.ObjectFreedError, rdt.TransferError, rdt.CollectiveGroupError):
        assert issubclass(e, rdt.RDTError)


def test_import_has_no_side_effects():
    code = (
        "import os, sys, threading; env = dict(os.environ); import rdt_async;"
        "assert threading.active_count() == 1, threading.enumerate();"
        "assert dict(os.environ) == env;"
        "assert 'nixl' not in sys.modules and 'ucxx' not in sys.modules;"
        "assert 'rdt_async.transports.shm' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_available_transports_names_every_builtin():
    avail = rdt.available_transports()
    assert avail["auto"] is True and avail["shm"] is True and avail["object_store"] is True


def test_transports_import_without_ray():
    """The GPU machine runs the transport contract suite with torch and no Ray."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import rdt_async as rdt\n"
        "from rdt_async.transports import _registry\n"
        "assert _registry.transport('shm').name == 'shm' and rdt.Transport and rdt.RDTError\n"
        "try:\n    rdt.fetch\nexcept ImportError as e:\n    print('needs ray' if 'pip install' in str(e) else e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "needs ray", out.stderr


def test_the_contract_suite_runs_without_ray():
    """What the GPU machine runs: tests/transports, with torch and no Ray installed."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/transports', '-k', 'shm and intact']))\n"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
