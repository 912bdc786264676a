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


class VllmLoraTarget(RankModelTarget):
    """vLLM LoRA adapter slots (`p2psync.adapters.vllm.lora.serve_lora`): a PEFT adapter's
    tensors, packed and scaled as vLLM's loader leaves them, into the slot's host copy."""

    name = "vllm-lora"
    requires = ("vllm",)

    def rank_model(self, table: TargetTable) -> RankModel:
        from ..peft.lora import slot_rejecter
        from .lora_shim import LoraSettings, Packing, lora_engine_config
        from .shim import version

        reject = slot_rejecter(table, engine="vLLM", key="vllm", version=version)
        key = table.layout_key
        config = lora_engine_config(key["hf_config"], tp=int(key["tp"]), dtype=str(key["dtype"]),
                                    settings=LoraSettings(**key["lora"]))
        try:
            return Packing(config, table.rank, key["adapter"], [(p.name, tuple(p.shape), p.dtype) for p in table.params])
        except ValueError as exc:
            raise reject(f"vLLM cannot build this rank's LoRA manager: {exc}") from exc

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
