"""The layout key of an sglang rank: everything that decides its bytes besides the rank index.

The engine side publishes it; the trainer side checks it and rebuilds the rank
model from it alone (the HF config travels inside the key), so a trainer needs
none of the engine's files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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
_SETTINGS = ("tp_size", "ep_size", "moe_a2a_backend", "moe_runner_backend", *_TRIVIAL)


def config_hash(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


def settings(server_args: Any) -> dict[str, Any]:
    """The server settings that shape a rank's bytes, from sglang's ServerArgs (or its /get_server_info)."""
    get = server_args.get if isinstance(server_args, Mapping) else lambda name: getattr(server_args, name)
    return {name: get(name) for name in _SETTINGS}


def layout_key(server_args: Any, hf_config: dict[str, Any], dtype: str, version: str) -> dict[str, Any]:
    """The key of a rank of an sglang engine: its settings, its HF config (as a dict) and
    resolved dtype, and the sglang version it runs."""
    return {
        "sglang": version,
        "architecture": hf_config["architectures"][0],
        "config_sha256": config_hash(hf_config),
        "config": hf_config,
        "dtype": dtype.removeprefix("torch."),
        **settings(server_args),
    }


def rank_spec(table: TargetTable, version: str) -> RankSpec:
    """Check `table`'s key against what this trainer can reproduce; the spec to rebuild its rank.

    Raises ConnectError naming engine, rank and reason.
    """
    key = table.layout_key

    def reject(reason: str) -> ConnectError:
        return ConnectError(f"{where(table.engine_id, table.rank)}: {reason}")

    missing = [k for k in ("sglang", "config", "config_sha256", "dtype", *_SETTINGS) if k not in key]
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
        moe_a2a_backend=str(key["moe_a2a_backend"]),
        moe_runner_backend=str(key["moe_runner_backend"]),
    )
