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
}
_WHY = {
    "enable_eplb": "EPLB moves experts between ranks at run time",
    "ep_num_redundant_experts": "redundant experts replicate physical experts the layout does not place",
    "init_expert_location": "a non-trivial initial expert location permutes experts across ranks",
    "pp_size": "pipeline parallelism is not supported by this layout",
    "enable_dp_attention": "data-parallel attention is not supported by this layout",
}
_SETTINGS = ("tp_size", "ep_size", "moe_a2a_backend", "moe_runner_backend", "quantization", *_TRIVIAL)


def config_hash(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


def settings(server_args: Any) -> dict[str, Any]:
    """The server settings that shape a rank's bytes, from sglang's ServerArgs (or its /get_server_info)."""
    get = server_args.get if isinstance(server_args, Mapping) else lambda name: getattr(server_args, name)
    return {name: get(name) for name in _SETTINGS}


def layout_key(
    server_args: Any, hf_config: dict[str, Any], dtype: str, version: str, fp8_post_load: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The key of a rank of an sglang engine: its settings, its HF config (as a dict, with the
    checkpoint's `quantization_config`) and resolved dtype, the sglang version it runs, and for
    an fp8 checkpoint what decides sglang's fp8 post-load step (`shim.fp8_post_load_settings`,
    evaluated in the engine's process; None where unknown)."""
    return {
        "sglang": version,
        "architecture": hf_config["architectures"][0],
        "config_sha256": config_hash(hf_config),
        "config": hf_config,
        "dtype": dtype.removeprefix("torch."),
        "fp8_post_load": fp8_post_load,
        **settings(server_args),
    }


def fp8_config(hf_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's fp8 `quantization_config`, None for an unquantized one."""
    config = hf_config.get("quantization_config")
    return dict(config) if config and config.get("quant_method") == "fp8" else None


def _quantization_problem(key: Mapping[str, Any]) -> str | None:
    """Why a layout cannot reproduce this key's quantization, or None."""
    config = key["config"].get("quantization_config")
    method = config.get("quant_method") if config else None
    if key["quantization"] not in (None, method):
        return (
            f"quantization={key['quantization']!r} with a checkpoint quantized as {method!r}: sglang quantizes "
            "while loading, which no layout reproduces; serve an fp8 checkpoint (quantization_config in its config)"
        )
    if config is None:
        return None
    if method != "fp8":
        return f"the checkpoint's quant_method is {method!r}: only fp8 checkpoints are supported"
    post_load = key.get("fp8_post_load")
    block = config.get("weight_block_size")
    if post_load is None:
        return (
            "the engine did not say how sglang processes fp8 weights after loading (a server's own endpoint "
            "does not); serve p2psync's endpoint in the server (the plugin)"
        )
    if post_load["platform"] not in ("cpu", "cuda"):
        return (
            f"platform {post_load['platform']!r}: sglang rewrites fp8 weights after loading there "
            "(e4m3fnuz and aiter shuffles on ROCm, its own layouts on NPU, XPU, MUSA)"
        )
    if post_load["cpu_amx_engine"]:
        return "SGLANG_USE_CPU_ENGINE=1: sglang prepacks fp8 weights for AMX after loading"
    if post_load["deepgemm_ue8m0"] and block is not None and list(block) == [128, 128]:
        return (
            "DeepGEMM with UE8M0 scales (SGLANG_ENABLE_JIT_DEEPGEMM on this GPU): sglang requantizes [128, 128] "
            "block scales to powers of two and packs them after loading; set SGLANG_ENABLE_JIT_DEEPGEMM=0"
        )
    if block is None and post_load["platform"] != "cpu":
        return (
            f"per-tensor fp8 on {post_load['platform']}: sglang requantizes fused shards to one scale, "
            "or converts scales per channel, after loading; serve block-quantized fp8 (weight_block_size)"
        )
    return None


def rank_spec(table: TargetTable, version: str) -> RankSpec:
    """Check `table`'s key against what this trainer can reproduce; the spec to rebuild its rank.

    Raises ConnectError naming engine, rank and reason.
    """
    key = table.layout_key

    def reject(reason: str) -> ConnectError:
        return ConnectError(f"{where(table.engine_id, table.rank)}: {reason}")

    missing = [k for k in ("sglang", "config", "config_sha256", "dtype", "fp8_post_load", *_SETTINGS) if k not in key]
    if missing:
        raise reject(f"layout key lacks {missing}; was the engine side started by another p2psync?")
    if key["sglang"] != version:
        raise reject(f"engine runs sglang {key['sglang']}, the trainer has sglang {version}; install the same version on both")
    if config_hash(key["config"]) != key["config_sha256"]:
        raise reject("the HF config in the layout key does not match its hash")
    for name, trivial in _TRIVIAL.items():
        if key[name] != trivial:
            raise reject(f"{name}={key[name]!r}: {_WHY[name]}")
    problem = _quantization_problem(key)
    if problem:
        raise reject(problem)
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
