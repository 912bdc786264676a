"""Trainer side of a vLLM engine: its layouts and the control client of its ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...core.endpoint import EndpointControl
from ...core.engine import EngineControl, EngineTarget
from ...core.layout import Layout
from ...core.types import ParamSpec, TargetTable

LAYOUTS = ("copy_map", "replica")


class VllmEngineTarget(EngineTarget):
    """vLLM engine ranks that run p2psync's endpoint (see `endpoint.serve` and the
    `p2psync` weight-transfer backend). Option `layout`: "copy_map" (default) or "replica"."""

    name = "vllm"
    requires = ("vllm",)

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        from .layouts import CopyMapLayout, ReplicaLayout

        kind = self.options.get("layout", "copy_map")
        if kind not in LAYOUTS:
            raise ValueError(f"vLLM layout must be one of {LAYOUTS}, got {kind!r}")
        return (CopyMapLayout if kind == "copy_map" else ReplicaLayout)(table, sources)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
