"""Megatron-Core name tables of GLM-4.5 MoE, GLM-4.7-Flash, DeepSeek-V3.2 and GLM-5: Megatron-Core
0.16.1 builds each on CPU (local spec, TP 1), the table names every one of its parameters, and the
source yields exactly the HF checkpoint's tensors (names and shapes; the MTP layer, which the
decoder does not hold, aside). Environment: py (any with megatron-core and transformers).

Megatron-Core 0.16.1 builds DeepSeek sparse attention with Transformer Engine only (its local spec
provider has no `linear()`), which needs CUDA: here the indexer's replicated linears are a stand-in
that names its parameter `weight`, as TE's TELinear does; every module path is Megatron's own.
Gemma is not here: Megatron-Core's local norm refuses `layernorm_zero_centered_gamma` (Gemma's
1 + w), so it too needs Transformer Engine."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core (p2psync[megatron]) is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from typing import Any  # noqa: E402

import torch  # noqa: E402
from p2psync.worlds.processes import context, process  # noqa: E402
from tests.helpers.model_configs import checkpoint, hf_config  # noqa: E402

KINDS = ("glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")


def megatron_config(hf: Any) -> Any:
    """Megatron-Core's TransformerConfig of the HF config `hf` (layer 0 dense, the rest MoE with a
    shared expert and a sigmoid router with an expert bias; MLA and DSA where `hf` has them)."""
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    layers = hf.num_hidden_layers
    common = dict(
        num_layers=layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, sequence_parallel=False,
        num_moe_experts=hf.n_routed_experts, moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_topk=hf.num_experts_per_tok, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_layer_freq=[int(i >= hf.first_k_dense_replace) for i in range(layers)],
        moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    )
    if not hasattr(hf, "kv_lora_rank"):  # GLM-4.5: grouped-query attention with a QKV bias
        return TransformerConfig(**common, kv_channels=hf.head_dim, add_qkv_bias=hf.attention_bias)
    dsa = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=hf.index_n_heads,
               dsa_indexer_head_dim=hf.index_head_dim, dsa_indexer_topk=hf.index_topk) if hasattr(hf, "index_topk") else {}
    return MLATransformerConfig(
        **common, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rope_type="rope", **dsa,
    )


def megatron_model(hf: Any) -> Any:
    """Megatron-Core's GPTModel of `hf` on CPU. Patches only what fails without CUDA and Transformer
    Engine and shapes no parameter: the router's expert bias and MLA's rotary embedding ask for the
    CUDA device; MLA checks `isinstance(..., TELinear)` against megatron-core's TE mock; the local
    DotProductAttention does not take MLA's k/v channels; DSA's indexer linears are TE's."""
    from unittest import mock

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class Replicated(torch.nn.Linear):
        """TE's TELinear(parallel_mode='duplicated') as the indexer builds it: one `weight`."""

        def __init__(self, input_size: int, output_size: int, *, bias: bool, **_: Any) -> None:
            super().__init__(input_size, output_size, bias=bias)

    class Backend(LocalSpecProvider):
        def linear(self) -> type:
            return Replicated

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    config = megatron_config(hf)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if config.experimental_attention_variant == "dsa":
            attention.core_attention = get_dsa_module_spec_for_backend(config, Backend()).submodules.core_attention
        elif attention.core_attention is DotProductAttention and hasattr(hf, "kv_lora_rank"):
            attention.core_attention = MLACoreAttention
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), mock.patch.object(mla, "HAVE_TE", te.HAVE_TE):
        return GPTModel(config, spec, vocab_size=hf.vocab_size, max_sequence_length=128,
                        position_embedding_type="rope", share_embeddings_and_output_weights=False)


def source_shapes(kinds: tuple[str, ...], results: Any) -> None:
    """In a fresh process (a gloo world of one): per kind, the HF names and shapes the Megatron source
    yields, or the error."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from p2psync.adapters.megatron import MegatronSource
    from p2psync.worlds import free_port

    configs = {kind: hf_config(kind) for kind in kinds}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    out = {}
    for kind, hf in configs.items():
        try:
            source = MegatronSource(megatron_model(hf), hf.model_type)
            out[kind] = {s.name: s.shape for s in source.param_specs()}
        except Exception as exc:  # reported per kind
            out[kind] = f"{type(exc).__name__}: {exc}"
    results.put(out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def yielded() -> dict[str, Any]:
    ctx = context()
    results = ctx.Queue()
    proc = process(ctx, source_shapes, (KINDS, results))
    proc.start()
    try:
        return results.get(timeout=300)
    finally:
        proc.join(timeout=30)


@pytest.mark.parametrize("kind", KINDS)
def test_the_megatron_source_yields_the_hf_checkpoint(yielded, kind):
    got = yielded[kind]
    assert isinstance(got, dict), got
    mtp = f"model.layers.{hf_config(kind).num_hidden_layers}."
    want = {name: tuple(t.shape) for name, t in checkpoint(kind).items() if not name.startswith(mtp)}
    assert got == want
    if kind in ("deepseek_v32", "glm_moe_dsa"):
        assert {n for n in got if ".indexer." in n} == {
            f"model.layers.{i}.self_attn.indexer.{w}" for i in range(2)
            for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
        }


def test_miles_model_names_reach_the_new_tables():
    """miles and slime name the model by its HF config class (`type(hf_config).__name__`)."""
    from p2psync.integrations.miles import megatron_architecture

    assert [megatron_architecture(n) for n in ("Glm4MoeConfig", "Glm4MoeLiteConfig", "DeepseekV32Config",
                                                "GlmMoeDsaConfig")] == list(KINDS)
