"""A vLLM server's own pause and version routes around p2psync's endpoints in its workers.

Where the workers' endpoints publish the API server's address (`P2PSyncInitInfo.server_url`,
table extra "server_url"), a session pauses and resumes the server through vLLM's RL routes
(vLLM 0.33.0, `vllm/entrypoints/rl/online/api_router.py`): `POST /pause?mode=...&clear_cache=...`
(vLLM clears its KV and prefix caches as it pauses, after draining), `POST /update_weight_version`
(the version `GET /weight_info` reports) and `POST /resume`. The endpoints hold each update's
lease, fence off unfinished updates and run vLLM's post-load step, as without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.control import http_json
from ...core.errors import ControlError, where
from ...core.pause import PauseMode
from ...core.types import TargetTable
from ...engine.endpoint import EndpointControl

#: vLLM's names for the modes it has, best first: a drain (its caches cleared after it), then
#: requests frozen in place ("keep": they continue on their old KV, and vLLM clears nothing), then abort.
VLLM_MODES: dict[PauseMode, str] = {"wait": "wait", "in_place": "keep", "abort": "abort"}


class VllmServedControl(EndpointControl):
    """Ranks served by p2psync's endpoints in the workers of one vLLM server: the lease, the
    post-load step and digests through the endpoints; pausing, caches, the version and resuming
    through the server."""

    def __init__(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> None:
        super().__init__(tables, timeout=timeout, token=token)
        self.server_url = str(self.tables[0].extra["server_url"])

    def _server(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET `path` (no body) or POST `body` to the server."""
        try:
            return http_json(self.server_url, path, body, timeout=self.timeout)
        except ControlError as exc:
            raise type(exc)(f"{where(self.tables[0].engine_id)}: the vLLM server: {exc}") from exc

    def check_access(self) -> None:
        super().check_access()
        self._server("/is_paused")

    def pause_modes(self) -> tuple[PauseMode, ...]:
        return tuple(VLLM_MODES)

    def pause(self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True) -> list[TargetTable]:
        # the endpoints serve no requests of their own ("wait" drains nothing) and hold no cache
        moved = super().pause(version, lease, "wait", flush_cache=False)
        self._server(f"/pause?mode={VLLM_MODES[mode]}&clear_cache={'true' if flush_cache else 'false'}", {})
        return moved

    def finish(self, version: str) -> None:
        super().finish(version)
        self._server("/update_weight_version", {"new_version": version})
        self._server("/resume", {})
