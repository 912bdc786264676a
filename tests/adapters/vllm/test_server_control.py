"""A vLLM server's pause modes, driven through vLLM 0.33.0's own RL router (its FastAPI routes,
served on loopback over an engine client that records what reaches it): each mode's calls, in
order, with vLLM's names and cache flag (environment conformance-vllm; vLLM cannot run its
server on CPU, so the engine client is a recorder)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")

from p2psync.adapters.torch import serve  # noqa: E402
from p2psync.adapters.vllm.server import VllmServedControl  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from p2psync.worlds import free_port  # noqa: E402
from tests.helpers.engines import RecordingTransport, small_model  # noqa: E402


class RecordingEngineClient:
    """The part of vLLM's `EngineClient` the RL routes call, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.paused = False

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause_generation", mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation",))
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("update_weight_version", new_version))


@contextmanager
def vllm_rl_server() -> Iterator[tuple[str, RecordingEngineClient]]:
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router

    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = client = RecordingEngineClient()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "vLLM's router did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", client
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.conformance(engine="vllm", via="vllm server pause modes")
def test_each_pause_mode_reaches_vllms_router_in_order_and_the_default_drains():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="vllm-modes", is_server=True, timeout=5)
    with vllm_rl_server() as (url, client):
        endpoint = serve(small_model(1), engine_id="v", rendezvous=rendezvous, transport=RecordingTransport(),
                         extra={"server_url": url}, version="v0")
        try:
            control = VllmServedControl(rendezvous.read_engine("v"), timeout=10, token=rendezvous.token())
            control.check_access()
            assert control.pause_modes() == ("wait", "in_place", "abort")
            for version, mode, flush in (("v1", "wait", True), ("v2", "in_place", False), ("v3", "abort", True)):
                client.calls.clear()
                control.pause(version, 30, mode, flush_cache=flush)
                assert endpoint.state.updating == version  # the endpoint holds the update's lease
                control.finish(version)
                vllm_mode = {"in_place": "keep"}.get(mode, mode)
                assert client.calls == [
                    ("pause_generation", vllm_mode, flush), ("update_weight_version", version), ("resume_generation",)
                ]
                assert endpoint.version == version and endpoint.state.serving
        finally:
            endpoint.close()
