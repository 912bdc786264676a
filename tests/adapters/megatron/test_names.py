"""Megatron name table and tensor conversions: pure functions, no megatron-core needed."""

from __future__ import annotations

import pytest
import torch

from p2psync.adapters.megatron.convert import Heads, split, unshard
from p2psync.adapters.megatron.names import ARCHITECTURES, Split, canonical, table


@pytest.mark.parametrize(
    ("name", "canon", "layer", "expert"),
    [
        ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None, None),
        ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
         "decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight", 3, None),
        ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
         "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight", 1, 2),
        ("decoder.layers.0.mlp.experts.linear_fc2.weight11",
         "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight", 0, 11),
    ],
)
def test_canonical_names_of_both_specs(name: str, canon: str, layer: int | None, expert: int | None) -> None:
    got = canonical(name)
    assert (got.name, got.layer, got.expert) == (canon, layer, expert)


@pytest.mark.parametrize(
    ("local", "te"),
    [
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ],
)
def test_local_and_te_spellings_name_the_same_hf_tensor(local: str, te: str) -> None:
    rules = table("qwen3")
    prefix = "decoder.layers.{layer}."
    assert rules[prefix + local] == rules[prefix + te]


def test_mla_te_spellings() -> None:
    rules = table("deepseek_v3")
    prefix = "decoder.layers.{layer}.self_attention."
    assert rules[prefix + "q_layernorm.weight"] == rules[prefix + "linear_q_up_proj.layer_norm_weight"]
    assert rules[prefix + "kv_layernorm.weight"] == rules[prefix + "linear_kv_up_proj.layer_norm_weight"]


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="known: .*qwen3"):
        table("llama9")
    assert {"qwen2", "qwen3", "qwen3_moe", "deepseek_v3"} <= set(ARCHITECTURES)


def test_stride_two_shards_become_gate_then_up() -> None:
    gate, up = torch.arange(4.0).reshape(4, 1), torch.arange(4.0, 8.0).reshape(4, 1)
    shards = [torch.cat([gate[2 * r : 2 * r + 2], up[2 * r : 2 * r + 2]]) for r in range(2)]
    got_gate, got_up = split(unshard(shards, 0, 2), Split.GATE_UP)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)


def test_qkv_splits_per_kv_group() -> None:
    heads = Heads(heads=4, groups=2, head_dim=3)
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    fused = torch.cat([q.view(2, 2, 3, 5), k.view(2, 1, 3, 5), v.view(2, 1, 3, 5)], 1).reshape(24, 5)
    for got, want in zip(split(fused, Split.QKV, heads), (q, k, v)):
        assert torch.equal(got, want)
