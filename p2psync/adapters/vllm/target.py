"""Trainer side of a vLLM engine: the rank model of each rank and the control client of its ranks."""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.endpoint import EndpointControl
from ...core.engine import EngineControl
from ...core.errors import ConnectError, where
from ...core.types import TargetTable
from ...layouts import EngineQuantization, RankModel, RankModelTarget


class VllmEngineTarget(RankModelTarget):
    """vLLM engine ranks that run p2psync's endpoint (see `endpoint.serve` and the
    `p2psync` weight-transfer backend). Options: `LayoutOptions` (`quantizer` for fp8 engines)."""

    name = "vllm"
    requires = ("vllm",)

    def rank_model(self, table: TargetTable) -> RankModel:
        from .key import engine_config_of
        from .shim import VllmRankModel

        config = engine_config_of(table)
        try:
            return VllmRankModel(config, table.rank)
        except ValueError as exc:  # vLLM's own refusals, e.g. a TP split its fp8 block size does not divide
            raise ConnectError(f"{where(table.engine_id, table.rank)}: vLLM cannot build this rank: {exc}") from exc

    def quantization(self, table: TargetTable) -> EngineQuantization | None:
        from .key import fp8_config

        config = fp8_config(table)
        return None if config is None else EngineQuantization(config, str(table.layout_key["dtype"]))

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        if "server_url" in tables[0].extra:  # the workers of a vLLM server: pause and resume through it
            from .server import VllmServedControl

            return VllmServedControl(tables, timeout=timeout, token=token)
        return EndpointControl(tables, timeout=timeout, token=token)
