"""Tiny models and vLLM rank models for the vLLM adapter tests (no downloads)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from p2psync.adapters.vllm import shim
from p2psync.adapters.vllm.key import layout_key
from p2psync.worlds.oracles import vllm_loaded
from p2psync.core.types import ParamSpec, TargetParam, TargetTable

#: Tiny configs: KV heads fewer than some TP sizes (replication), vocab not a multiple of
#: the padding (vLLM pads the vocab to 64 per rank), tied and untied embeddings, MoE and MLA.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        cls="Qwen2Config", architectures=["Qwen2ForCausalLM"], vocab_size=250, hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        cls="Qwen3Config", architectures=["Qwen3ForCausalLM"], vocab_size=300, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig", architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
    ),
    "deepseek_v2": dict(
        cls="DeepseekV2Config", architectures=["DeepseekV2ForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1, topk_method="greedy", tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        cls="DeepseekV3Config", architectures=["DeepseekV3ForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1, tie_word_embeddings=False,
        # vLLM reads these; transformers' DeepseekV3Config does not define them.
        topk_method="noaux_tc", scoring_func="sigmoid",
    ),
}


#: A deep variant of a kind ("qwen3-deep"): enough decoder layers that layouts share compiled maps.
DEEP = "-deep"


def hf_config(kind: str, dtype: str = "bfloat16") -> Any:
    """The transformers config of `kind`; `<kind>-deep` has 5 decoder layers."""
    import transformers

    options = dict(CONFIGS[kind.removesuffix(DEEP)], **({"num_hidden_layers": 5} if kind.endswith(DEEP) else {}))
    config = getattr(transformers, options.pop("cls"))(**options, max_position_embeddings=256)
    config.dtype = dtype
    return config


def hf_model(kind: str, seed: int) -> Any:
    """A randomly initialized transformers model of `kind` (eager attention, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(kind, dtype="float32")
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def hf_tensors(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of `kind` (names and shapes as save_pretrained writes them), every
    element random: a zero-initialized bias would hide a region that was never written."""
    from safetensors.torch import load_file

    model = hf_model(kind, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out: dict[str, torch.Tensor] = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            out.update(load_file(str(path)))
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in out.items()}


def hf_config_dict(kind: str) -> dict[str, Any]:
    return json.loads(hf_config(kind).to_json_string(use_diff=False))


@lru_cache(maxsize=None)
def checkpoint(kind: str) -> dict[str, torch.Tensor]:
    """The HF tensors the layout tests load (seed 0), made once per process."""
    return hf_tensors(kind, seed=0)


def engine_rank(
    kind: str, tp: int, rank: int, tensors: Mapping[str, torch.Tensor], fill: int = 0
) -> tuple[dict[str, torch.Tensor], TargetTable]:
    """What vLLM itself holds on `rank` after loading `tensors` into parameters whose every byte
    was `fill`, and that rank's table."""
    config = shim.engine_config(hf_config_dict(kind), tp=tp, dtype="bfloat16")
    params = {name: p.data for name, p in vllm_loaded(config, rank, tensors, fill).named_parameters()}
    table = TargetTable(
        engine_id="engine", rank=rank, world_size=tp, engine="vllm", layout_key=layout_key(config),
        transport="none", transport_info={}, control_url="",
        params=tuple(
            TargetParam(name, tuple(t.shape), dtype_name(t), t.data_ptr(), t.numel() * t.element_size())
            for name, t in params.items()
        ),
    )
    return params, table


def specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, ParamSpec]:
    return {name: ParamSpec(name, tuple(t.shape), dtype_name(t)) for name, t in tensors.items()}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
