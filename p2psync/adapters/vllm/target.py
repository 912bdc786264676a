"""Trainer side of a vLLM engine: its layouts and the control client of its ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ...core.endpoint import EndpointControl
from ...core.engine import EngineControl, EngineTarget
from ...core.layout import Layout
from ...core.types import ParamSpec, TargetTable

@dataclass(frozen=True)
class VllmOptions:
    """`layout`: "copy_map" (strided copies; vLLM's loader only for parameters that are not
    copies) or "replica" (vLLM's loader for every group)."""

    layout: Literal["copy_map", "replica"] = "copy_map"


class VllmEngineTarget(EngineTarget):
    """vLLM engine ranks that run p2psync's endpoint (see `endpoint.serve` and the
    `p2psync` weight-transfer backend). Options: `VllmOptions`."""

    name = "vllm"
    requires = ("vllm",)
    Options = VllmOptions

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        from .layouts import CopyMapLayout, ReplicaLayout

        return (CopyMapLayout if self.options.layout == "copy_map" else ReplicaLayout)(table, sources)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
