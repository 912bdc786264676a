"""The layout key of an sglang rank: everything that decides its bytes besides the rank index.

The engine side publishes it; the trainer side checks it and rebuilds the rank
model from it alone (the HF config travels inside the key), so a trainer needs
none of the engine's files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ...core.errors import ConnectError, where
from ...core.types import TargetTable
from .shim import RankSpec

#: Server settings a layout cannot reproduce unless they hold these values.
_TRIVIAL = {
    "enable_eplb": False,
    "ep_num_redundant_experts": 0,
    "init_expert_location": "trivial",
    "pp_size": 1,
    "enable_dp_attention": False,
    "quantization": None,
}
_WHY = {
    "enable_eplb": "EPLB moves experts between ranks at run time",
    "ep_num_redundant_experts": "redundant experts replicate physical experts the layout does not place",
    "init_expert_location": "a non-trivial initial expert location permutes experts across ranks",
    "pp_size": "pipeline parallelism is not supported by this layout",
    "enable_dp_attention": "data-parallel attention is not supported by this layout",
    "quantization": "quantized sglang engines are not supported by this layout yet",
}


def config_hash(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


def layout_key(server_args: Any, model_config: Any, version: str) -> dict[str, Any]:
    """The key of a rank of an engine started with `server_args` (sglang's ServerArgs and ModelConfig)."""
    hf_config = json.loads(model_config.hf_config.to_json_string(use_diff=False))
    return {
        "sglang": version,
        "architecture": model_config.hf_config.architectures[0],
        "config_sha256": config_hash(hf_config),
        "config": hf_config,
        "tp_size": int(server_args.tp_size),
        "ep_size": int(server_args.ep_size),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "moe_a2a_backend": str(server_args.moe_a2a_backend),
        "moe_runner_backend": str(server_args.moe_runner_backend),
        **{name: getattr(server_args, name) for name in _TRIVIAL},
    }


def rank_spec(table: TargetTable, version: str) -> RankSpec:
    """Check `table`'s key against what this trainer can reproduce; the spec to rebuild its rank.

    Raises ConnectError naming engine, rank and reason.
    """
    key = table.layout_key

    def reject(reason: str) -> ConnectError:
        return ConnectError(f"{where(table.engine_id, table.rank)}: {reason}")

    missing = [k for k in ("sglang", "config", "config_sha256", "tp_size", "ep_size", "dtype", *_TRIVIAL) if k not in key]
    if missing:
        raise reject(f"layout key lacks {missing}; was the engine side started by another p2psync?")
    if key["sglang"] != version:
        raise reject(f"engine runs sglang {key['sglang']}, the trainer has sglang {version}; install the same version on both")
    if config_hash(key["config"]) != key["config_sha256"]:
        raise reject("the HF config in the layout key does not match its hash")
    for name, trivial in _TRIVIAL.items():
        if key[name] != trivial:
            raise reject(f"{name}={key[name]!r}: {_WHY[name]}")
    if not 0 <= table.rank < key["tp_size"]:
        raise reject(f"rank is outside tp size {key['tp_size']}")
    return RankSpec(
        hf_config=key["config"],
        tp_size=int(key["tp_size"]),
        ep_size=int(key["ep_size"]),
        dtype=str(key["dtype"]),
        rank=table.rank,
        quantization=key["quantization"],
        moe_a2a_backend=str(key.get("moe_a2a_backend", "none")),
        moe_runner_backend=str(key.get("moe_runner_backend", "auto")),
    )
