"""HF-config-shaped presets from public architecture numbers (no download).

Numbers from the models' public config.json files, as summarized in
shared/notes/anchors.md. Only the fields that decide parameter shapes are set.
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=128, num_key_value_heads=4,
    decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=8, tie_word_embeddings=False,
    attention_bias=False, vocab_size=151936, torch_dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, norm_topk_prob=True, hidden_act="silu",
)
_DEEPSEEK = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, n_shared_experts=1, num_experts_per_tok=8,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, tie_word_embeddings=False, torch_dtype="bfloat16", rms_norm_eps=1e-6,
    max_position_embeddings=163840, hidden_act="silu",
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)

PRESETS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": dict(
        _QWEN3_MOE, num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_attention_heads=32,
    ),
    "Qwen3-235B-A22B": dict(
        _QWEN3_MOE, num_hidden_layers=94, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_experts=128, num_attention_heads=64,
    ),
    "GLM-4.5-Air": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=46, first_k_dense_replace=1,
        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
        n_shared_experts=1, num_experts_per_tok=8, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, vocab_size=151552,
        tie_word_embeddings=False, torch_dtype="bfloat16", n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, rms_norm_eps=1e-5, max_position_embeddings=131072, hidden_act="silu",
    ),
    "DeepSeek-V3": dict(
        _DEEPSEEK, n_routed_experts=256, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
        first_k_dense_replace=3,
    ),
    "Kimi-K2": dict(
        _DEEPSEEK, n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64, vocab_size=163840,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
    ),
    # GLM-4.7-Flash and GLM-5: the released configs (transformers' Glm4MoeLiteConfig / GlmMoeDsaConfig defaults)
    "GLM-4.7-Flash": dict(
        _DEEPSEEK, architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", num_hidden_layers=47,
        hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64,
        num_experts_per_tok=4, num_attention_heads=20, num_key_value_heads=20, q_lora_rank=768, qk_nope_head_dim=192,
        v_head_dim=256, vocab_size=154880, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.8, rms_norm_eps=1e-5, max_position_embeddings=202752,
    ),
    "GLM-5": dict(
        _DEEPSEEK, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=78,
        hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
        vocab_size=154880, first_k_dense_replace=3, n_group=1, topk_group=1, rms_norm_eps=1e-5,
        max_position_embeddings=202752, index_n_heads=32, index_head_dim=128, index_topk=2048,
    ),
}

#: Published total parameter counts (anchors.md), to check the analytic model against.
PUBLISHED_PARAMS = {"Kimi-K2": 1.03e12, "DeepSeek-V3": 671e9, "GLM-4.5-Air": 106e9, "Qwen3-235B-A22B": 235e9,
                    "Qwen3-30B-A3B": 30.5e9, "GLM-4.7-Flash": 30e9, "GLM-5": 744e9}


def preset(name: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
