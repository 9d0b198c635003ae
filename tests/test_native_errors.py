"""Each transport says what its library's errors mean (`Transport.native_error`), by class
where the library has classes; the core words the message (`_errors.translate`).

The errors are the libraries' own: NIXL's and UCXX's classes, and what a real Gloo pair
raises when its peer's process exits.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

import rdt_async as rdt
from rdt_async._errors import translate
from rdt_async.transports import _registry


def _said(exc: BaseException, transport: str) -> BaseException:
    return translate(exc, f"{transport} fetch of obj1", "obj1", transport=_registry.transport_class(transport))


def test_nixl_disconnect_is_a_dead_peer_and_its_other_errors_are_backend_errors():
    bindings = pytest.importorskip("nixl._bindings")
    gone = _said(bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"), "nixl")
    assert type(gone) is rdt.PeerDiedError and gone.obj_id == "obj1"
    assert str(gone) == "nixl fetch of obj1: the producer disconnected (nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT)"
    for cls in (bindings.nixlBackendError, bindings.nixlNotAllowedError, bindings.nixlInvalidParamError):
        err = _said(cls("NIXL_ERR_X"), "nixl")
        assert type(err) is rdt.BackendError
        assert str(err) == f"nixl fetch of obj1 failed in nixl: {cls.__name__}: NIXL_ERR_X"


_UCXX_CHECK = """
import rdt_async as rdt
from rdt_async._errors import translate
from rdt_async.transports import ucxx
lib = ucxx._load()
said = lambda exc: translate(exc, "ucxx fetch of obj1", "obj1", transport=ucxx.UcxxTransport)
for cls in (lib.UCXConnectionResetError, lib.UCXNotConnectedError, lib.UCXEndpointTimeoutError):
    print(cls.__name__, type(said(cls("gone"))).__name__)
err = said(lib.UCXMessageTruncatedError("short"))
print(type(err).__name__, err)
"""


def test_ucxx_reset_endpoint_is_a_dead_peer_and_its_other_errors_are_backend_errors():
    # In a process of its own: UCXX's UCX would keep NIXL's out of this one (so not even
    # pytest.importorskip, which imports it here).
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed")
    out = subprocess.run([sys.executable, "-c", _UCXX_CHECK], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == [
        "UCXXConnectionResetError PeerDiedError",
        "UCXXNotConnectedError PeerDiedError",
        "UCXXEndpointTimeoutError PeerDiedError",
        "BackendError ucxx fetch of obj1 failed in ucxx: UCXXMessageTruncatedError: short",
    ], out.stderr


def test_shm_missing_segment_is_a_freed_object():
    err = _said(FileNotFoundError(2, "No such file or directory"), "shm")
    assert type(err) is rdt.ObjectFreedError and err.obj_id == "obj1"
    assert str(err).startswith("shm fetch of obj1: the object was freed, or its producer died (FileNotFoundError")


def test_errors_no_transport_claims_are_backend_errors_and_ours_pass_through():
    err = _said(ValueError("odd"), "nixl" if _registry.transport_class("nixl").unavailable_reason() is None else "shm")
    assert type(err) is rdt.BackendError and str(err).endswith("failed: ValueError: odd")
    assert type(_said(FileNotFoundError("x"), "object_store")) is rdt.BackendError  # only shm reads files
    ours = rdt.ObjectFreedError("freed", obj_id="obj1")
    assert _said(ours, "shm") is ours
    timeout = TimeoutError("late")
    assert _said(timeout, "shm") is timeout


def _peer(port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.ProcessGroupGloo(dist.PrefixStore("t", store), 1, 2, timedelta(seconds=30))
    time.sleep(0.5)
    os._exit(1)  # gone mid-call, as a killed actor


def test_gloo_says_a_peer_left_only_in_text_and_that_text_is_a_dead_peer():
    import torch.distributed as dist

    from rdt_async.transports import gloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    peer = mp.get_context("spawn").Process(target=_peer, args=(store.port,))
    peer.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), 0, 2, timedelta(seconds=30))
        with pytest.raises(RuntimeError) as raised:
            pg.recv([torch.zeros(4)], 1, 0).wait()
    finally:
        peer.join(30)
    assert type(raised.value) is RuntimeError  # no class of Gloo's own
    assert gloo.lost_peer(raised.value)
    assert type(_said(raised.value, "gloo")) is rdt.PeerDiedError
    assert not gloo.lost_peer(RuntimeError("Invalid tensor size"))
    assert type(_said(RuntimeError("Invalid tensor size"), "gloo")) is rdt.BackendError
