"""This process's NIXL agent: loading nixl, creating the agent, and calls that hold it.

NIXL's progress thread waits for UCX events up to `PROGRESS_US` between rounds (NIXL's
Python API asks for 0, which spins a core): over TCP or RDMA a READ moves only while
the producer's worker progresses, and the thread does that at once, at ~0.4% of a core
when idle. The agent is created with NIXL_THREAD_SYNC_STRICT, and our own lock sits on
top of it so that the I/O loop only ever *tries* to take the agent: under CMA
`transfer()` does the whole copy while holding NIXL's lock, and a loop waiting on it
would stall for the copy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ... import _io
from ..._errors import TransportUnavailableError
from .. import _net, _ucx
from .._kit import int_setting

T = TypeVar("T")

INSTALL_HINT = "pip install 'rdt_async[nixl]'"
# NIXL's progress thread waits for UCX events up to this long between rounds (RDT_NIXL_PROGRESS_US).
# Over TCP a READ moves only while the producer's worker progresses: without the thread, a
# producer polling every 20 ms held cross-host reads to 40 ms at 4 KiB and 0.2 GiB/s. With
# it, 6.6 ms and ~1 GiB/s; idle, the thread costs ~0.4% of a core (1 ms: ~4%; 0: a core).
PROGRESS_US = 10_000
# UCX settings this transport needs and UCX's defaults do not give, set while an agent is
# made in a process with a GPU, unless the user set them (`ucx_settings`). UCX turns
# cuda_ipc's GET off on a GPU without NVLink links ("auto": reads slower than writes on
# some PCIe systems), and a NIXL READ is a GET: a READ of GPU memory on the same node then went over TCP through host
# staging, 0.43 GB/s on an H100 where the device copy moves ~1.5 TB/s.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
_BUSY = object()  # what `try_call` returns when the agent is held elsewhere


@functools.cache
def import_reason() -> str | None:
    """Return why nixl cannot be loaded here, or None (and keep NIXL's INFO lines off stdout)."""
    try:
        spec = importlib.util.find_spec("nixl")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"the nixl package is not installed: {INSTALL_HINT}"
    try:
        importlib.import_module("nixl._api")
    except Exception as exc:  # a broken install is a reason, not a crash
        return f"nixl is installed but cannot be loaded ({type(exc).__name__}: {exc}); reinstall with {INSTALL_HINT}"
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs at INFO to stdout by default (an agent's start prints two lines):
        # a library's stdout belongs to the program. NIXL_LOG_LEVEL still rules.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return None


@contextlib.contextmanager
def ucx_settings(network: dict[str, str] | None = None) -> Iterator[None]:
    """Make an agent inside: UCX gets this transport's settings (UCX_DEFAULTS, and
    `network`, those of `_ucx.settings`) where the environment names none, and a CUDA
    context first, where the process has a GPU.

    UCX gives an agent its CUDA transports for remote reads only if the process has a
    CUDA context when the agent is made: made first, a READ of GPU memory on the same
    node went over TCP for the agent's life (0.5 GB/s on an H200, against ~1.5 TB/s).
    The settings are UCX's CUDA ones, so only a process with a GPU gets them (elsewhere
    UCX warns of a variable it does not know), and only while the agent is made (UCX
    reads them then): they are not left to the process's children.
    """
    added = {k: v for k, v in UCX_DEFAULTS.items() if k not in os.environ} if _cuda_context() else {}
    added.update(network or {})  # its network (`_ucx.settings`)
    with _ucx.environment(added):
        yield


def _cuda_context() -> bool:
    """Make the current device's primary CUDA context if this process has a usable GPU; say whether it has."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or torch.cuda._is_in_bad_fork():
        return False
    try:
        torch.cuda.synchronize()  # makes the context, if not yet made
    except Exception as exc:  # CUDA unusable here: CPU memory still moves
        logging.getLogger("rdt_async").debug("rdt_async: nixl's agent is made without a CUDA context: %s", exc)
        return False
    return True


def _progress_delay_us() -> int:
    return int_setting("RDT_NIXL_PROGRESS_US", PROGRESS_US, 0, "microseconds as an integer >= 0 (0: no progress thread)")


def _new_agent(nixl_agent: Any, name: str, cfg: Any, delay_us: int) -> Any:
    """A NIXL agent whose progress thread waits up to `delay_us` for UCX events between rounds.

    NIXL's Python API always asks for a delay of 0 (the thread spins a core); its C++ config
    takes any delay, so the config class is swapped for one that keeps ours while the agent
    is made (callers make one agent at a time).
    """
    if delay_us <= 0:
        return nixl_agent(name, cfg)
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, delay_us if key == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = _Config
    try:
        return nixl_agent(name, cfg)
    finally:
        api.nixlBind.nixlAgentConfig = base


class Agent:
    """This process's NIXL agent, and the lock that lets the I/O loop only try it.

    `lock` guards every call into `nixl` that touches the agent's state (NIXL's own
    lock would make a waiting loop stall for a whole CMA copy).
    """

    def __init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = f"rdt-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        delay = _progress_delay_us()
        cfg = nixl_agent_config(
            enable_prog_thread=delay > 0,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        # Not UCX's devices (`_ucx.settings`): NIXL's UCX crashed a producer (a SIGSEGV in
        # `ucp_ep_set_lanes_failed`) whose peer on its host saw other interfaces than its
        # own, as a process whose agent was made before `ray.init` does, and making such an
        # agent anew left the old one to crash its process. Its ports keep to RDT_PORT_RANGE.
        # (UCX reads its environment as the agent's backend makes its context.)
        with ucx_settings(_ucx.settings(_net.ADVERTISE_ENV, devices=False)):
            self.nixl = _new_agent(nixl_agent, self.name, cfg, delay)
        if "UCX" not in self.nixl.backends:
            raise TransportUnavailableError(
                f"transport 'nixl' is unavailable: NIXL's UCX backend did not load; reinstall with {INSTALL_HINT}"
            )
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def locked(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn` holding the agent (blocking: from the pool or a producer thread)."""
        with self.lock:
            return fn(*args)

    def try_call(self, fn: Callable[..., Any], *args: Any, busy: Any = _BUSY) -> Any:
        """Call `fn` holding the agent if it is free now; else return `busy` at once."""
        if not self.lock.acquire(blocking=False):
            return busy
        try:
            return fn(*args)
        finally:
            self.lock.release()

    async def call(
        self, fn: Callable[..., T], *args: Any, slow: bool = False, undo: Callable[[T], None] | None = None
    ) -> T:
        """Call `fn` holding the agent: inline when free and quick, else in the pool.

        A cancel waits for a call already in the pool (see `_io.to_thread_finished`); `undo` gets what it made.
        """
        if not slow:
            out = self.try_call(fn, *args)
            if out is not _BUSY:
                done: T = out
                return done
        return await _io.to_thread_finished(self.locked, fn, *args, undo=undo)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn` now if the agent is free, else in the pool; never wait, never raise."""
        try:
            if self.try_call(fn, *args) is not _BUSY:
                return
        except Exception:
            return
        _io.pool().submit(quietly, self.locked, fn, *args)


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Call `fn`, dropping its error (releases and clean-ups with nobody to tell)."""
    try:
        fn(*args)
    except Exception:
        pass
