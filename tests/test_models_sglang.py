"""sglang layouts of the model classes miles ships P2P for, and one whose engine derives buffers
after loading: every TP/EP rank's bytes equal sglang's own `load_weights` on that rank, bit for bit.
Environment: conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

from functools import lru_cache  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from sglang_models import config_dict, hf_tensors, produce, sglang_rank, specs  # noqa: E402

from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402

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
MOE_KINDS = ("glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")  # DeepSeek-V3: test_sglang_layout
CASES = [
    *[(kind, tp, ep) for kind in MOE_KINDS for tp, ep in ((1, 1), (2, 1), (2, 2))],
    *[(kind, tp, 1) for kind in ("gemma", "gemma2") for tp in (1, 2)],
]


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


def engine_rank(kind: str, tp: int, ep: int, rank: int):
    """sglang's own load of the checkpoint on `rank` (given copies: some loaders change their input)."""
    tensors = {name: t.clone() for name, t in checkpoint(kind).items()}
    return sglang_rank(config_dict(hf_config(kind)), tp, ep, rank, tensors)


@pytest.mark.parametrize("kind,tp,ep", CASES, ids=[f"{k}-tp{t}-ep{e}" for k, t, e in CASES])
def test_copy_map_equals_sglang_load_on_every_rank(kind, tp, ep):
    tensors = checkpoint(kind)
    before = {name: t.clone() for name, t in tensors.items()}
    for rank in range(tp):
        expected, table = engine_rank(kind, tp, ep, rank)
        layout = SglangEngineTarget().layout(table, specs(tensors))
        held = produce(layout, tensors, table)
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.contiguous().view(-1).view(torch.uint8)), (kind, tp, ep, rank, name)
        if kind == "gemma":  # 1 + w is no copy: sglang's loader writes the norms, and only them
            assert layout.loader_params and all(n.endswith("norm.weight") for n in layout.loader_params)
        else:
            assert layout.loader_params == [], "these loaders only copy and pad"
    for name, t in tensors.items():  # every target of a bucket is filled from the same HF tensors
        assert torch.equal(t, before[name]), f"a layout changed the trainer's HF tensor {name}"


def test_indexer_weights_are_in_the_layout():
    """DeepSeek-V3.2's sparse-attention indexer: each of its weights is a group's output."""
    tensors = checkpoint("deepseek_v32")
    _, table = engine_rank("deepseek_v32", 2, 1, 1)
    layout = SglangEngineTarget().layout(table, specs(tensors))
    outputs = {name for group in layout.groups() for name in group.outputs}
    indexer = {p.name for p in table.params if ".indexer." in p.name}
    assert {n.rsplit(".indexer.", 1)[1] for n in indexer} == {
        "wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias",
    }
    assert indexer <= outputs


def test_gemma2_post_load_on_layout_bytes_derives_what_sglangs_load_derives():
    """Gemma 2's norms keep `gemma_weight` (1 + w, a buffer, not a parameter): an engine whose parameters
    got the layout's bytes and then ran sglang's post-load step holds it as sglang's own load does."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, post_load

    tensors = checkpoint("gemma2")
    expected, table = engine_rank("gemma2", 2, 1, 1)
    layout = SglangEngineTarget().layout(table, specs(tensors))
    spec = RankSpec(config_dict(hf_config("gemma2")), 2, 1, "bfloat16", 1)
    engine = build_rank_model(spec, "cpu")
    for name, data in produce(layout, tensors, table).items():
        engine.model.get_parameter(name).data.view(-1).view(torch.uint8).copy_(data)
    post_load(engine.model)
    reference = build_rank_model(spec, "cpu")
    reference.load([(n, t.clone()) for n, t in tensors.items()])
    derived = {n: b for n, b in reference.model.named_buffers() if n.endswith("gemma_weight")}
    assert derived and all(b.ne(1).any() for b in derived.values()), "sglang's load derived no gemma_weight"
    held = dict(engine.model.named_buffers())
    for name, buffer in derived.items():
        assert torch.equal(held[name], buffer), name


@pytest.mark.parametrize("kind,derives", [("gemma2", True), ("deepseek_v32", True), ("glm4_moe", False)])
def test_models_that_derive_tensors_after_loading_are_known(kind, derives):
    """A real server's own transfer-engine endpoint cannot redo a post-load step: `publish_server`
    refuses the models this names."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, derives_after_load

    model = build_rank_model(RankSpec(config_dict(hf_config(kind)), 1, 1, "bfloat16", 0), "meta").model
    assert derives_after_load(model) is derives
