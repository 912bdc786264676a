"""Tiny random configs of the model classes miles ships P2P for (GLM-4.5 MoE, GLM-4.7-Flash,
DeepSeek-V3 and V3.2, GLM-5) and of Gemma / Gemma 2, as transformers configs, and their HF checkpoint
tensors (with the MTP layer a checkpoint holds): shared by the sglang, draft and Megatron tests."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from tests.helpers.sglang_models import hf_tensors

_COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
#: Layer 0 dense, layer 1 MoE with a shared expert and a sigmoid router with a score bias.
_MOE = dict(
    intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
)
_MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4)
#: DeepSeek-V3.2's sparse-attention indexer (GLM-5 has the same).
_INDEXER = dict(index_n_heads=4, index_head_dim=32, index_topk=8)
#: sglang's MLA attention on CPU supports YaRN rotary embeddings only.
_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}

#: kind -> (transformers config class, sglang architecture, config fields).
#: The MoE models carry one MTP (NextN) layer after their last layer, which sglang's draft loads.
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        **_COMMON, **_MOE, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
        tie_word_embeddings=False, num_nextn_predict_layers=1)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, rope_parameters=_YARN, tie_word_embeddings=False, num_nextn_predict_layers=1)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, rope_parameters=_YARN, tie_word_embeddings=False, num_nextn_predict_layers=1)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, **_INDEXER, rope_parameters=_YARN, tie_word_embeddings=False,
        num_nextn_predict_layers=1)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, **_INDEXER, rope_parameters=_YARN, tie_word_embeddings=False,
        num_nextn_predict_layers=1)),
    # sglang's Gemma loader stores a norm as 1 + w (into the HF tensor it was given):
    # no copy, so the engine's loader writes those parameters.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        **_COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    # Gemma 2's norms copy w and derive a `gemma_weight` buffer (1 + w) after loading.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        **_COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        sliding_window=32, query_pre_attn_scalar=16, hidden_act="gelu_pytorch_tanh")),
}
def hf_config(kind: str) -> Any:
    """A tiny transformers config of `kind`, as sglang reads it (bfloat16)."""
    import transformers

    cls, architecture, fields = MODELS[kind]
    config = getattr(transformers, cls)(**fields)
    # fields sglang's DeepSeek-family models read that transformers' configs lack
    config.moe_layer_freq, config.topk_method, config.scoring_func = 1, "noaux_tc", "sigmoid"
    config.architectures = [architecture]
    config.torch_dtype = "bfloat16"
    return config


@lru_cache(maxsize=None)
def checkpoint(kind: str) -> dict[str, torch.Tensor]:
    """The HF checkpoint tensors of `kind`, with its MTP layer where it has one: transformers builds
    no MTP layer, so layer N's tensors are made as a checkpoint holds them (a decoder layer like
    N - 1's, eh_proj, enorm, hnorm, shared_head.norm; DeepSeek-V3 also repeats the embedding and
    head there, which sglang's draft does not load: it takes the target's)."""
    config = hf_config(kind)
    tensors = hf_tensors(config)
    last = config.num_hidden_layers
    if not getattr(config, "num_nextn_predict_layers", 0):
        return tensors
    generator = torch.Generator().manual_seed(last)
    hidden = config.hidden_size
    mtp = {
        name.replace(f"model.layers.{last - 1}.", f"model.layers.{last}."): torch.randn(t.shape, generator=generator)
        for name, t in tensors.items() if name.startswith(f"model.layers.{last - 1}.")
    }
    extra = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
             "shared_head.norm.weight": (hidden,)}
    if kind == "deepseek_v3":
        extra |= {"embed_tokens.weight": (config.vocab_size, hidden), "shared_head.head.weight": (config.vocab_size, hidden)}
    mtp |= {f"model.layers.{last}.{name}": torch.randn(shape, generator=generator) for name, shape in extra.items()}
    return tensors | mtp
