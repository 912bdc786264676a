"""Megatron-Core parameter names -> HF checkpoint names, one table per architecture.

A Megatron name is first made *canonical*: the stage-local layer number becomes
`{layer}`, and a local expert (`experts.local_experts.<j>.` in the local spec,
`experts.linear_fc1.weight<j>` in Transformer Engine's grouped spec) becomes
`experts.{expert}.`. The table maps canonical names to HF name templates and to
how the gathered tensor splits (fused QKV, fused gate/up). Both the local-spec
and the Transformer-Engine spellings are listed, so either spec maps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Split(Enum):
    """How one gathered Megatron tensor becomes HF tensors."""

    COPY = "copy"
    QKV = "qkv"  # [q x heads_per_group, k, v] per KV group -> q, k, v
    GATE_UP = "gate_up"  # [gate; up] -> gate, up
    REPEAT = "repeat"  # one tensor -> the same tensor under each name (a fused linear's LoRA A)


@dataclass(frozen=True)
class Rule:
    """HF name templates (with `{layer}` / `{expert}`) for one canonical Megatron name.
    `stride`: the TP partition stride to unshard with, where the tensor's own attribute does not
    say it (a LoRA B of gated `linear_fc1`: each rank's rows are its [gate; up], as the base's)."""

    hf: tuple[str, ...]
    split: Split = Split.COPY
    stride: int | None = None


_L = "model.layers.{layer}."


def _copy(hf: str) -> Rule:
    return Rule((hf,))


def _qkv(suffix: str) -> Rule:
    return Rule(tuple(f"{_L}self_attn.{p}_proj.{suffix}" for p in "qkv"), Split.QKV)


def _gate_up(prefix: str) -> Rule:
    return Rule((f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"), Split.GATE_UP)


_M = "decoder.layers.{layer}."

EMBEDDINGS: dict[str, Rule] = {
    "embedding.word_embeddings.weight": _copy("model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": _copy("model.norm.weight"),
    "output_layer.weight": _copy("lm_head.weight"),
}

GQA: dict[str, Rule] = {
    _M + "input_layernorm.weight": _copy(_L + "input_layernorm.weight"),
    _M + "self_attention.linear_qkv.layer_norm_weight": _copy(_L + "input_layernorm.weight"),
    _M + "self_attention.linear_qkv.weight": _qkv("weight"),
    _M + "self_attention.linear_qkv.bias": _qkv("bias"),
    _M + "self_attention.q_layernorm.weight": _copy(_L + "self_attn.q_norm.weight"),
    _M + "self_attention.k_layernorm.weight": _copy(_L + "self_attn.k_norm.weight"),
    _M + "self_attention.linear_proj.weight": _copy(_L + "self_attn.o_proj.weight"),
}

MLA: dict[str, Rule] = {
    _M + "input_layernorm.weight": _copy(_L + "input_layernorm.weight"),
    _M + "self_attention.linear_q_proj.weight": _copy(_L + "self_attn.q_proj.weight"),
    _M + "self_attention.linear_q_down_proj.weight": _copy(_L + "self_attn.q_a_proj.weight"),
    _M + "self_attention.q_layernorm.weight": _copy(_L + "self_attn.q_a_layernorm.weight"),
    _M + "self_attention.linear_q_up_proj.layer_norm_weight": _copy(_L + "self_attn.q_a_layernorm.weight"),
    _M + "self_attention.linear_q_up_proj.weight": _copy(_L + "self_attn.q_b_proj.weight"),
    _M + "self_attention.linear_kv_down_proj.weight": _copy(_L + "self_attn.kv_a_proj_with_mqa.weight"),
    _M + "self_attention.kv_layernorm.weight": _copy(_L + "self_attn.kv_a_layernorm.weight"),
    _M + "self_attention.linear_kv_up_proj.layer_norm_weight": _copy(_L + "self_attn.kv_a_layernorm.weight"),
    _M + "self_attention.linear_kv_up_proj.weight": _copy(_L + "self_attn.kv_b_proj.weight"),
    _M + "self_attention.linear_proj.weight": _copy(_L + "self_attn.o_proj.weight"),
}

DENSE_MLP: dict[str, Rule] = {
    _M + "pre_mlp_layernorm.weight": _copy(_L + "post_attention_layernorm.weight"),
    _M + "mlp.linear_fc1.layer_norm_weight": _copy(_L + "post_attention_layernorm.weight"),
    _M + "mlp.linear_fc1.weight": _gate_up(_L + "mlp."),
    _M + "mlp.linear_fc2.weight": _copy(_L + "mlp.down_proj.weight"),
}

MOE: dict[str, Rule] = {
    _M + "mlp.router.weight": _copy(_L + "mlp.gate.weight"),
    _M + "mlp.experts.{expert}.linear_fc1.weight": _gate_up(_L + "mlp.experts.{expert}."),
    _M + "mlp.experts.{expert}.linear_fc2.weight": _copy(_L + "mlp.experts.{expert}.down_proj.weight"),
}

SHARED_EXPERTS: dict[str, Rule] = {
    _M + "mlp.router.expert_bias": _copy(_L + "mlp.gate.e_score_correction_bias"),
    _M + "mlp.shared_experts.linear_fc1.weight": _gate_up(_L + "mlp.shared_experts."),
    _M + "mlp.shared_experts.linear_fc2.weight": _copy(_L + "mlp.shared_experts.down_proj.weight"),
}

_INDEXER = _M + "self_attention.core_attention.indexer."
#: DeepSeek sparse attention's indexer (Megatron's DSAIndexer; its linears are replicated).
DSA_INDEXER: dict[str, Rule] = {
    _INDEXER + "linear_wq_b.weight": _copy(_L + "self_attn.indexer.wq_b.weight"),
    _INDEXER + "linear_wk.weight": _copy(_L + "self_attn.indexer.wk.weight"),
    _INDEXER + "k_norm.weight": _copy(_L + "self_attn.indexer.k_norm.weight"),
    _INDEXER + "k_norm.bias": _copy(_L + "self_attn.indexer.k_norm.bias"),
    _INDEXER + "linear_weights_proj.weight": _copy(_L + "self_attn.indexer.weights_proj.weight"),
}

_DEEPSEEK_V3 = {**EMBEDDINGS, **MLA, **DENSE_MLP, **MOE, **SHARED_EXPERTS}
#: HF `model_type` -> canonical Megatron name -> rule.
ARCHITECTURES: dict[str, dict[str, Rule]] = {
    "qwen2": {**EMBEDDINGS, **GQA, **DENSE_MLP},
    "qwen3": {**EMBEDDINGS, **GQA, **DENSE_MLP},
    "qwen3_moe": {**EMBEDDINGS, **GQA, **DENSE_MLP, **MOE},
    "deepseek_v3": _DEEPSEEK_V3,
    "glm4_moe": {**EMBEDDINGS, **GQA, **DENSE_MLP, **MOE, **SHARED_EXPERTS},  # GLM-4.5 (-Air)
    "glm4_moe_lite": _DEEPSEEK_V3,  # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE
    "deepseek_v32": {**_DEEPSEEK_V3, **DSA_INDEXER},
    "glm_moe_dsa": {**_DEEPSEEK_V3, **DSA_INDEXER},  # GLM-5
}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc\d\.(?:weight|bias))(\d+)$")


@dataclass(frozen=True)
class Canonical:
    """A Megatron name with its stage-local layer and local expert index taken out."""

    name: str
    layer: int | None
    expert: int | None


def canonical(name: str) -> Canonical:
    """Canonical form of a (wrapper-free) Megatron parameter name."""
    layer = expert = None
    if m := _LAYER.match(name):
        layer = int(m.group(1))
        name = "decoder.layers.{layer}." + name[m.end() :]
    if m := _LOCAL_EXPERT.search(name):
        expert = int(m.group(1))
        name = name[: m.start()] + ".experts.{expert}." + name[m.end() :]
    elif m := _GROUPED_EXPERT.search(name):
        expert = int(m.group(2))
        name = name[: m.start()] + ".experts.{expert}." + m.group(1)
    return Canonical(name, layer, expert)


def table(architecture: str) -> dict[str, Rule]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"no Megatron name table for architecture {architecture!r}; known: {sorted(ARCHITECTURES)}"
        ) from None
