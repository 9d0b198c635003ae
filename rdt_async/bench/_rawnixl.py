"""Raw NIXL, as a user would drive it without rdt_async: the baseline of the NIXL benchmarks (no Ray)."""

from __future__ import annotations

from typing import Any


def agent(name: str, *, rdt_settings: bool = True) -> Any:
    """A NIXL agent set up as the transport's own (UCX, no progress thread); with
    `rdt_settings=False`, without the UCX set-up rdt_async gives its agents (`ucx_settings`)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    from rdt_async.transports.nixl._agent import import_reason, ucx_settings

    import_reason()  # NIXL's INFO lines off stdout, as for the transport's own agents
    cfg = nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    if not rdt_settings:
        return nixl_agent(name, cfg)
    with ucx_settings():  # what a user would need too (cuda_ipc GETs on a GPU without NVLink)
        return nixl_agent(name, cfg)


def read(agent: Any, local: Any, remote_descs: Any, remote: str) -> None:
    """One READ, posted and polled to its end on this thread. Raises: RuntimeError unless DONE."""
    h = agent.initialize_xfer("READ", local, remote_descs, remote)
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    agent.release_xfer_handle(h)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL READ ended in {state}")
