"""Trainer side of sglang engines: layouts of each rank and control of each engine."""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.endpoint import EndpointControl
from ...core.engine import EngineControl
from ...core.errors import ConnectError, where
from ...core.types import TargetTable
from ...layouts import EngineQuantization, RankModel, RankModelTarget


class SglangEngineTarget(RankModelTarget):
    """sglang engines: ranks running `p2psync.adapters.sglang.serve` (standalone, or inside a
    server through the plugin: then paused and resumed through the server's API), or a
    real sglang server whose tables `publish_server` made (controlled through its own API).
    Options: `LayoutOptions` (`quantizer` for fp8 engines).
    """

    name = "sglang"
    requires = ("sglang",)

    def rank_model(self, table: TargetTable) -> RankModel:
        from .key import rank_spec
        from .shim import build_rank_model, require_sglang

        try:
            version = require_sglang()
        except (ImportError, RuntimeError) as exc:
            raise ConnectError(f"{where(table.engine_id, table.rank)}: this trainer cannot build sglang layouts: {exc}") from exc
        spec = rank_spec(table, version)
        try:
            return build_rank_model(spec, "meta")
        except ValueError as exc:  # sglang's own refusals, e.g. a TP split its fp8 block size does not divide
            raise ConnectError(f"{where(table.engine_id, table.rank)}: sglang cannot build this rank: {exc}") from exc

    def quantization(self, table: TargetTable) -> EngineQuantization | None:
        from .key import fp8_config

        config = fp8_config(table.layout_key["config"])
        return None if config is None else EngineQuantization(config, str(table.layout_key["dtype"]))

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        from .server import SERVER_CONTROL, ServedControl, ServerControl

        if tables[0].extra.get("control") == SERVER_CONTROL:
            return ServerControl(tables[0].control_url, engine_id=tables[0].engine_id, timeout=timeout)
        if "server_url" in tables[0].extra:
            return ServedControl(tables, timeout=timeout, token=token)
        return EndpointControl(tables, timeout=timeout, token=token)


class SglangLoraTarget(RankModelTarget):
    """sglang LoRA adapter slots (`p2psync.adapters.sglang.serve_lora`): a PEFT adapter's tensors,
    stacked as sglang's loader stacks them, into the slot's host copy. Refused at connect:
    what sglang would scale or apply otherwise than PEFT (rsLoRA, DoRA)."""

    name = "sglang-lora"
    requires = ("sglang",)

    def rank_model(self, table: TargetTable) -> RankModel:
        from ..peft.lora import slot_rejecter
        from .key import config_hash
        from .lora_shim import Normalization
        from .shim import require_sglang

        reject = slot_rejecter(table, engine="sglang", key="sglang", version=require_sglang)
        key = table.layout_key
        if config_hash(key["config"]) != key["config_sha256"]:
            raise reject("the HF config in the layout key does not match its hash")
        config = key["adapter"]
        if config.get("use_rslora"):
            raise reject("sglang scales every LoRA by lora_alpha / r; rsLoRA's lora_alpha / sqrt(r) would be lost")
        if config.get("use_dora"):
            raise reject("sglang does not serve DoRA adapters")
        return Normalization(key["config"], config, [(p.name, tuple(p.shape), p.dtype) for p in table.params])

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
