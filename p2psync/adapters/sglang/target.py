"""Trainer side of sglang engines: layouts of each rank and control of each engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ...core.endpoint import EndpointControl
from ...core.engine import EngineControl, EngineTarget
from ...core.errors import ConnectError, where
from ...core.layout import Layout
from ...core.types import ParamSpec, TargetTable


@dataclass(frozen=True)
class SglangOptions:
    """`layout`: "copy_map" (strided copies; sglang's loader only for parameters that are not
    copies) or "replica" (sglang's loader for every group)."""

    layout: Literal["copy_map", "replica"] = "copy_map"


class SglangEngineTarget(EngineTarget):
    """sglang engines: ranks running `p2psync.adapters.sglang.serve` (standalone, or inside a
    server through the plugin: then paused and resumed through the server's API), or a
    real sglang server whose tables `publish_server` made (controlled through its own API).
    Options: `SglangOptions` (give them through `Session(engine_options={"sglang": {...}})`).
    """

    name = "sglang"
    requires = ("sglang",)
    Options = SglangOptions

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        from .layout import SglangLayout
        from .shim import require_sglang

        try:
            version = require_sglang()
        except (ImportError, RuntimeError) as exc:
            raise ConnectError(f"{where(table.engine_id, table.rank)}: this trainer cannot build sglang layouts: {exc}") from exc
        return SglangLayout(table, sources, mode=self.options.layout, version=version)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        from .server import SERVER_CONTROL, ServedControl, ServerControl

        if tables[0].extra.get("control") == SERVER_CONTROL:
            return ServerControl(tables[0].control_url, engine_id=tables[0].engine_id, timeout=timeout)
        if "server_url" in tables[0].extra:
            return ServedControl(tables, timeout=timeout, token=token)
        return EndpointControl(tables, timeout=timeout, token=token)
