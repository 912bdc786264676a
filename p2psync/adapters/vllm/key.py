"""The layout key of a vLLM rank: everything that decides its bytes besides the rank index.

The engine side publishes it (`layout_key`); the trainer side checks it and rebuilds the
vLLM config from it alone (`engine_config_of`: the HF config travels inside the key), so
a trainer needs none of the engine's files.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ...core.errors import ConnectError, where
from ...core.types import TargetTable
from . import shim

if TYPE_CHECKING:
    import torch


def config_hash(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


#: Expert placements no layout reproduces: key entry -> (the vLLM setting, its trivial value, why).
_PLACEMENTS = {
    "eplb": ("enable_eplb", False, "EPLB moves experts between ranks at run time"),
    "redundant_experts": (
        "eplb_config.num_redundant_experts", 0, "redundant experts replicate physical experts the layout does not place"
    ),
    "expert_placement": ("expert_placement_strategy", "linear", "a round-robin placement permutes experts across ranks"),
    "elastic_ep": ("enable_elastic_ep", False, "elastic EP re-places experts as EP ranks join and leave"),
}


def _speculative(vllm_config: Any) -> dict[str, Any] | None:
    """The engine's speculative draft, if it runs one with weights (the p2psync backend does not
    publish a draft's parameters: `P2PSyncWeightTransferEngine.supports_draft_weight_update`)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return None
    return {"method": spec.method, "draft_architecture": spec.draft_model_config.architectures[0], "published": False}


def layout_key(vllm_config: Any, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The key of a rank of a vLLM engine: its parallelism, expert placement, dtype, quantization
    (the checkpoint's `quantization_config` travels in the HF config), speculative draft, HF config
    and the vLLM version it runs; for fp8, the kernels of the rank's `model` (`shim.fp8_kernels`),
    which decide its post-load step."""
    config, parallel = vllm_config.model_config, vllm_config.parallel_config
    hf_config = json.loads(config.hf_config.to_json_string(use_diff=False))
    fp8 = config.quantization == "fp8"
    if fp8 and model is None:
        raise ValueError("an fp8 vLLM rank's layout key needs its model (its fp8 kernels decide its post-load step)")
    return {
        "vllm": shim.version(),
        "architecture": config.architectures[0],
        "hf_config_sha256": config_hash(hf_config),
        "hf_config": hf_config,
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "dp": parallel.data_parallel_size,
        "ep": bool(parallel.enable_expert_parallel),
        "eplb": bool(parallel.enable_eplb),
        "redundant_experts": int(parallel.eplb_config.num_redundant_experts),
        "expert_placement": str(parallel.expert_placement_strategy),
        "elastic_ep": bool(parallel.enable_elastic_ep),
        "dtype": str(config.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "fp8_kernels": shim.fp8_kernels(model) if fp8 and model is not None else None,
        "speculative": _speculative(vllm_config),
    }


def fp8_config(table: TargetTable) -> dict[str, Any] | None:
    """The fp8 `quantization_config` of `table`'s checkpoint, None for an unquantized one."""
    if table.layout_key.get("quantization") != "fp8":
        return None
    return dict(table.layout_key["hf_config"]["quantization_config"])


def _quantization_problem(key: dict[str, Any]) -> str | None:
    quantization = key.get("quantization")
    if not quantization:
        return None
    if quantization != "fp8":
        return f"quantization {quantization!r} is not supported (fp8 is)"
    if "quantization_config" not in key.get("hf_config", {}):
        return "quantization 'fp8' without a quantization_config in the HF config: vLLM quantizes while loading"
    linear = (key.get("fp8_kernels") or {}).get("linear")
    if linear != [shim.FP8_STAND_IN]:
        return (
            f"fp8 kernels {key.get('fp8_kernels')!r}: vLLM's post-load step (process_weights_after_loading) "
            "rewrites fp8 weights and scales into these kernels' format, which p2psync cannot redo after its "
            "writes yet; only ranks holding the loader's format (p2psync's CPU rank models) are served"
        )
    return None


def engine_config_of(table: TargetTable) -> Any:
    """The VllmConfig `table`'s key describes; ConnectError, naming engine, rank and every
    reason, for what no layout reproduces."""
    key = table.layout_key
    problems = []
    if key.get("vllm") != shim.VLLM_VERSION:
        problems.append(f"engine runs vllm {key.get('vllm')}, layouts are pinned to {shim.VLLM_VERSION}")
    if "hf_config" not in key or config_hash(key["hf_config"]) != key.get("hf_config_sha256"):
        problems.append("the HF config in the layout key does not match its hash")
    quantization = _quantization_problem(key)
    if quantization:
        problems.append(quantization)
    for entry, (setting, trivial, why) in _PLACEMENTS.items():
        if key.get(entry, trivial) != trivial:
            problems.append(f"{setting}={key[entry]!r}: {why}")
    if draft := key.get("speculative"):
        problems.append(
            f"speculative draft ({draft['method']}, {draft['draft_architecture']}): the engine did not publish the "
            "draft's parameters, so an update would leave the draft stale"
        )
    if key.get("pp", 1) != 1 or key.get("dp", 1) != 1 or key.get("ep"):
        problems.append(
            f"only tensor parallelism is supported (pp={key.get('pp')}, dp={key.get('dp')}, ep={key.get('ep')})"
        )
    if key.get("tp") != table.world_size:
        problems.append(f"tp {key.get('tp')} differs from the engine's {table.world_size} ranks")
    if problems:
        raise ConnectError(f"{where(table.engine_id, table.rank)}: " + "; ".join(problems))
    return shim.engine_config(key["hf_config"], tp=key["tp"], dtype=key["dtype"])
