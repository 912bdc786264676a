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
    "elastic_ep_backend": None,
    "ep_join_mode": None,
    "pp_size": 1,
    "enable_dp_attention": False,
}
_WHY = {
    "enable_eplb": "EPLB moves experts between ranks at run time",
    "ep_num_redundant_experts": "redundant experts replicate physical experts the layout does not place",
    "init_expert_location": "a non-trivial initial expert location permutes experts across ranks",
    "elastic_ep_backend": "elastic EP re-places experts as EP ranks join and leave",
    "ep_join_mode": "an EP rank that joins or recovers at run time gets experts the layout does not place",
    "pp_size": "pipeline parallelism is not supported by this layout",
    "enable_dp_attention": "data-parallel attention is not supported by this layout",
}
_SETTINGS = ("tp_size", "ep_size", "moe_a2a_backend", "moe_runner_backend", "quantization", *_TRIVIAL)
#: Speculative algorithms whose draft is the checkpoint's own MTP (NextN) layers (NEXTN resolves to EAGLE).
_MTP_ALGORITHMS = ("EAGLE", "NEXTN")


def config_hash(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


def settings(server_args: Any) -> dict[str, Any]:
    """The server settings that shape a rank's bytes, from sglang's ServerArgs (or its /get_server_info)."""
    get = server_args.get if isinstance(server_args, Mapping) else lambda name: getattr(server_args, name)
    return {name: get(name) for name in _SETTINGS}


def draft_settings(server_args: Any, published: bool) -> dict[str, Any] | None:
    """What decides the bytes of the rank's speculative draft (None: the engine runs none), and
    whether the rank published the draft's parameters (`published`)."""
    get = server_args.get if isinstance(server_args, Mapping) else lambda name: getattr(server_args, name)
    algorithm = get("speculative_algorithm")
    if algorithm is None or str(algorithm).upper() == "NGRAM":  # n-gram drafts have no weights
        return None
    draft_path = get("speculative_draft_model_path")
    return {
        "algorithm": str(algorithm).upper(),
        "own_checkpoint": draft_path is not None and draft_path != get("model_path"),
        "multi_layer_eagle": bool(get("enable_multi_layer_eagle")),
        "moe_runner_backend": get("speculative_moe_runner_backend"),
        "moe_a2a_backend": get("speculative_moe_a2a_backend"),
        "quantization": get("speculative_draft_model_quantization"),
        "token_map": get("speculative_token_map") is not None,
        "published": published,
    }


def layout_key(
    server_args: Any, hf_config: dict[str, Any], dtype: str, version: str, fp8_post_load: dict[str, Any] | None = None,
    *, draft_published: bool = False,
) -> dict[str, Any]:
    """The key of a rank of an sglang engine: its settings, its HF config (as a dict, with the
    checkpoint's `quantization_config`) and resolved dtype, the sglang version it runs, and for
    an fp8 checkpoint what decides sglang's fp8 post-load step (`shim.fp8_post_load_settings`,
    evaluated in the engine's process; None where unknown), and its speculative draft (`draft_settings`)."""
    return {
        "sglang": version,
        "architecture": hf_config["architectures"][0],
        "config_sha256": config_hash(hf_config),
        "config": hf_config,
        "dtype": dtype.removeprefix("torch."),
        "fp8_post_load": fp8_post_load,
        **settings(server_args),
        "speculative": draft_settings(server_args, draft_published),
    }


def _draft_refusal(draft: dict[str, Any], key: dict[str, Any]) -> str | None:
    """Why the rank's draft cannot be updated with it, or None."""
    algorithm = draft["algorithm"]
    if algorithm not in _MTP_ALGORITHMS:
        return f"{algorithm} drafts are not reproduced (only a checkpoint's own MTP/NextN layers, NEXTN or EAGLE)"
    if draft["own_checkpoint"]:
        return "the draft has its own checkpoint (speculative_draft_model_path), which the trainer does not train"
    if draft["multi_layer_eagle"]:
        return "multi-layer EAGLE (enable_multi_layer_eagle) is not reproduced"
    for backend in ("moe_runner_backend", "moe_a2a_backend"):  # None: sglang gives the draft the target's
        if draft[backend] not in (None, key[backend]):
            return f"the draft's MoE backend speculative_{backend}={draft[backend]!r} differs from the target's {key[backend]!r}"
    if draft["quantization"] is not None:
        return f"a quantized draft (speculative_draft_model_quantization={draft['quantization']!r}) is not reproduced"
    if draft["token_map"]:
        return "a hot-token map (speculative_token_map) gives the draft a head of selected rows, which is not reproduced"
    if not draft["published"]:
        return "the engine did not publish the draft's parameters: an update would leave the draft stale"
    return None


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

    missing = [
        k for k in ("sglang", "config", "config_sha256", "dtype", "fp8_post_load", *_SETTINGS, "speculative") if k not in key
    ]
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
    draft = key["speculative"]
    if draft is not None and (why := _draft_refusal(draft, key)):
        raise reject(f"speculative draft ({draft['algorithm']}): {why}")
    return RankSpec(
        hf_config=key["config"],
        tp_size=int(key["tp_size"]),
        ep_size=int(key["ep_size"]),
        dtype=str(key["dtype"]),
        rank=table.rank,
        quantization=key["quantization"],
        moe_a2a_backend=str(key["moe_a2a_backend"]),
        moe_runner_backend=str(key["moe_runner_backend"]),
        draft=draft is not None,
    )
