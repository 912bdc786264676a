"""A real sglang server as a target: its own Mooncake endpoint and its own control API.

A server started with `--remote-instance-weight-loader-start-seed-via-transfer-engine`
registers each rank's weights with Mooncake and tells where they are at
`/remote_instance_transfer_engine_info?rank=N` (session, and per parameter its
address, element count and size). `publish_server` turns that, with the server's
settings from `/get_server_info`, into target tables in the rendezvous, so a
Session connects to the server like to any engine; `ServerControl` drives it
through `/pause_generation`, `/begin_weight_update`, `/end_weight_update`,
`/flush_cache`, `/update_weight_version` and `/continue_generation`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...engine.endpoint import EndpointControl
from ...core.control import http_json
from ...core.engine import EngineControl
from ...core.errors import ConnectError, ControlError, RendezvousError, where
from ...core.pause import PauseMode
from ...core.types import Region, TargetParam, TargetTable
from .key import layout_key, rank_spec

if TYPE_CHECKING:
    from ...core.rendezvous import Rendezvous

#: `TargetTable.extra["control"]` of tables made by `publish_server`.
SERVER_CONTROL = "sglang-server"
#: The route that shows a server and its scheduler answer. Not `/health`: it generates a
#: token, which a server left paused (by a failed update) never does, and the next update
#: must still reach that server to bring it back.
ALIVE = "/server_info"

log = logging.getLogger(__name__)


def publish_server(
    url: str,
    *,
    engine_id: str,
    rendezvous: Rendezvous,
    hf_config: dict[str, Any],
    timeout: float = 30.0,
    version: str | None = None,
) -> list[TargetTable]:
    """Publish the target table of every rank of the sglang server at `url`.

    `hf_config` is the model's HF config (the trainer's own; the server's files
    need not be readable here). Shapes and dtypes come from sglang's rank model
    rebuilt on meta and must agree with the element counts the server reports.
    The server serves only weights of a known version: unless `version` declares the
    one it loaded (and is then named on the server, so that its responses' version spans
    name p2psync's versions), it is paused here until its first update. Another live server
    already published under `engine_id` is refused; a dead one is replaced.
    """
    from .shim import build_rank_model, derives_after_load, require_sglang

    info = http_json(url, "/get_server_info", timeout=timeout)
    if info.get("dtype") in (None, "auto"):
        raise ConnectError(f"{where(engine_id)}: start the server with an explicit --dtype, so its bytes are known")
    key = layout_key(info, hf_config, str(info["dtype"]), str(info.get("version")))
    tables = []
    for rank in range(int(info["tp_size"])):
        answer = http_json(url, f"/remote_instance_transfer_engine_info?rank={rank}", timeout=timeout)
        session, weights = answer["remote_instance_transfer_engine_info"]
        draft = TargetTable(engine_id, rank, int(info["tp_size"]), "sglang", key, "mooncake", {}, url, ())
        model = build_rank_model(rank_spec(draft, require_sglang()), "meta").model
        if derives_after_load(model):
            raise ConnectError(
                f"{where(engine_id, rank)}: {key['architecture']} derives weights after loading, which the "
                "server's own transfer-engine endpoint cannot redo; serve p2psync's endpoint through the plugin"
            )
        table = TargetTable(
            engine_id=engine_id, rank=rank, world_size=int(info["tp_size"]), engine="sglang", layout_key=key,
            transport="mooncake", transport_info={"session": session}, control_url=url,
            params=tuple(_param(engine_id, rank, name, p, weights) for name, p in model.named_parameters()),
            job_id=rendezvous.job_id, extra={"control": SERVER_CONTROL}, instance=f"sglang server {url}",
        )
        tables.append(_claim(rendezvous, table, timeout))
    if version is None:
        http_json(url, "/pause_generation", {"mode": "abort"}, timeout=timeout)
    else:
        http_json(url, "/update_weight_version", {"new_version": version, "abort_all_requests": False}, timeout=timeout)
    return tables


def _claim(rendezvous: Rendezvous, table: TargetTable, timeout: float) -> TargetTable:
    """Publish `table`, replacing an earlier table of this server, or of a server that is gone."""
    held = rendezvous.publish(table)
    if held is None:
        return table
    if held.instance != table.instance:
        try:
            http_json(held.control_url, ALIVE, timeout=min(timeout, 5.0))
            alive = True
        except ControlError:
            alive = False
        if alive:
            raise RendezvousError(
                f"{where(table.engine_id, table.rank)} is already served by {held.instance} (incarnation "
                f"{held.incarnation}), which still answers: stop it or publish this server under another engine id"
            )
        log.warning("%s: replacing %s, which no longer answers", where(table.engine_id, table.rank), held.instance)
    table = dataclasses.replace(table, incarnation=held.incarnation + 1)
    if rendezvous.publish(table, replacing=held) is not None:
        raise RendezvousError(f"{where(table.engine_id, table.rank)}: another publisher claimed it meanwhile")
    return table


def _param(engine_id: str, rank: int, name: str, param: Any, weights: Mapping[str, Sequence[int]]) -> TargetParam:
    if name not in weights:
        raise ConnectError(f"{where(engine_id, rank, name)}: the server registered no such weight")
    addr, numel, size = (int(x) for x in weights[name])
    if (numel, size) != (param.numel(), param.element_size()):
        raise ConnectError(
            f"{where(engine_id, rank, name)}: the server holds {numel} elements of {size} bytes, "
            f"sglang's rank model {param.numel()} of {param.element_size()}"
        )
    return TargetParam(name, tuple(param.shape), str(param.dtype).removeprefix("torch."), addr, numel * size)


class ServerControl(EngineControl):
    """Control of one sglang server through its HTTP API. Its pause modes are sglang's
    /pause_generation modes, best first: "retract" (the default: nothing aborted, and the
    requests' KV recomputed with the new weights), "in_place", "abort"."""

    MODES: tuple[PauseMode, ...] = ("retract", "in_place", "abort")

    def __init__(self, url: str, *, engine_id: str, timeout: float) -> None:
        self.url = url
        self.engine_id = engine_id
        self.timeout = timeout
        self._mode: PauseMode | None = None  # of the update in progress
        self._flush = True

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return http_json(self.url, path, body, timeout=self.timeout)
        except ControlError as exc:
            raise type(exc)(f"{where(self.engine_id)}: {exc}") from exc

    def check_access(self) -> None:
        try:
            http_json(self.url, ALIVE, timeout=self.timeout)
        except ControlError as exc:
            raise type(exc)(f"{where(self.engine_id)}: {exc}") from exc

    def pause_modes(self) -> tuple[PauseMode, ...]:
        return self.MODES

    def pause(self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True) -> None:
        """Pause generation in `mode` and open sglang's weight-update session. A session still
        open is one a trainer abandoned mid-update (the server stayed paused): this update
        takes it over. The server itself holds no lease."""
        self._post("/pause_generation", {"mode": mode})
        self._mode, self._flush = mode, flush_cache
        try:
            self._post("/begin_weight_update", {})
        except ControlError as exc:
            if "already open" not in str(exc):
                raise
            log.warning(
                "%s: taking over the weight-update session an abandoned update left open", where(self.engine_id)
            )

    def finish(self, version: str) -> None:
        """End the weight-update session, flush the caches unless the pause said not to (the
        prefix cache holds what the old weights computed), name the new version (requests in flight record where it changed:
        their responses' version spans) and continue. A server paused "in_place" holds its
        frozen requests and their KV, and sglang flushes nothing while it holds requests: they
        continue on the old KV, and new requests may reuse old prefixes until the next flush."""
        self._post("/end_weight_update", {})
        if self._flush:
            try:
                self._post("/flush_cache", {})
            except ControlError as exc:
                if self._mode != "in_place":
                    raise
                log.warning("%s: caches kept (pause mode 'in_place' holds requests): %s", where(self.engine_id), exc)
        self._post("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        self._post("/continue_generation", {})
        self._mode = None

    def digest_refusal(self) -> str:
        """sglang's `/weights_checker` hashes whole tensors (sha256 on CPU, a triton hash on
        GPU), not the regions of them a trainer rank wrote; p2psync's endpoint inside the
        server (its plugin) digests exactly those."""
        return (
            "a server published with publish_server reports no digests of what was written; serve it"
            " with p2psync's sglang plugin for check=True, or connect with check=False"
        )

    def digests(self, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        raise ControlError(f"{where(self.engine_id, rank)}: {self.digest_refusal()}")


class ServedControl(EndpointControl):
    """Ranks served by p2psync's endpoint inside an sglang server (the plugin): access, digests
    and sglang's post-load step through the endpoints; pausing, flushing and the version
    through the server."""

    def __init__(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> None:
        super().__init__(tables, timeout=timeout, token=token)
        self.server = ServerControl(tables[0].extra["server_url"], engine_id=tables[0].engine_id, timeout=timeout)

    def check_access(self) -> None:
        super().check_access()
        self.server.check_access()

    def pause_modes(self) -> tuple[PauseMode, ...]:
        return self.server.pause_modes()

    def pause(self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True) -> list[TargetTable]:
        # each rank's endpoint holds the update's lease; none serves requests of its own ("wait"
        # drains nothing, no cache to flush): the server pauses them in `mode` and flushes
        moved = super().pause(version, lease, "wait", flush_cache=False)
        self.server.pause(version, lease, mode, flush_cache=flush_cache)
        return moved

    def finish(self, version: str) -> None:
        super().finish(version)  # each rank's endpoint runs sglang's post-load step
        self.server.finish(version)
