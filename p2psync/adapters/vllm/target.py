"""Trainer side of a vLLM engine: the rank model of each rank and the control client of its ranks."""

from __future__ import annotations

from collections.abc import Sequence

from ...core.endpoint import EndpointControl
from ...core.engine import EngineControl
from ...core.types import TargetTable
from ...layouts import RankModel, RankModelTarget


class VllmEngineTarget(RankModelTarget):
    """vLLM engine ranks that run p2psync's endpoint (see `endpoint.serve` and the
    `p2psync` weight-transfer backend). Options: `LayoutOptions`."""

    name = "vllm"
    requires = ("vllm",)

    def rank_model(self, table: TargetTable) -> RankModel:
        from .key import engine_config_of
        from .shim import VllmRankModel

        return VllmRankModel(engine_config_of(table), table.rank)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
