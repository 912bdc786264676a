"""Tiny Megatron-Core GPT models on CPU (gloo) shaped as a transformers model, for the
Megatron trainers of the conformance worlds and the Megatron source tests.

`load_hf` writes HF tensors into this rank's Megatron shards by hand (the inverse of
what the source does): the tests check it in meaning, Megatron's logits against
transformers' with the same weights (tests/adapters/megatron/test_source.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

@dataclass(frozen=True)
class Case:
    """One parallel layout of one architecture."""

    arch: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    variant: str = ""  # a name for a changed config (the tests' VARIANTS)
    vocab_pad: int = 0  # rows Megatron's vocabulary has beyond the HF one (its padding)

    @property
    def id(self) -> str:
        arch = f"{self.arch}-{self.variant}" if self.variant else self.arch
        pad = f"-pad{self.vocab_pad}" if self.vocab_pad else ""
        return f"{arch}-tp{self.tp}-pp{self.pp}-ep{self.ep}-etp{self.etp}{pad}"


def hide_cuda_only_kernels() -> None:
    """Make `flash_mla` absent on a machine without CUDA.

    sglang's environment installs flash_mla, a CUDA-only kernel package: without a CUDA
    driver its import raises OSError, while Megatron's attention module imports it
    expecting only ImportError. On a CPU machine the kernel cannot run anyway."""
    import sys

    if not torch.cuda.is_available():
        # `import flash_mla` now raises ImportError (typeshed types sys.modules as holding modules only)
        sys.modules.setdefault("flash_mla", None)  # type: ignore[arg-type]


def megatron_model(case: Case, hf: Mapping[str, Any]) -> Any:
    """This rank's GPTModel of `case` (model parallel state initialized here), shaped as the HF
    config `hf` (its keyword arguments or its config.json)."""
    hide_cuda_only_kernels()
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(case.tp, case.pp, expert_model_parallel_size=case.ep,
                                 expert_tensor_parallel_size=case.etp)
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
    mla = case.arch == "deepseek_v3"
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=case.arch == "qwen2", normalization="RMSNorm",
        qk_layernorm=case.arch != "qwen2", tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp, expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp, sequence_parallel=False, use_cpu_initialization=True,
        perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        **(dict(num_moe_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=hf["num_experts_per_tok"], moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False) if experts else {}),
        **(dict(q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rope_type="rope",
                moe_layer_freq=[int(i >= hf["first_k_dense_replace"]) for i in range(hf["num_hidden_layers"])],
                moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=hf["routed_scaling_factor"]) if mla else {}),
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    with mla_on_cpu(spec) if mla else nullcontext():
        return GPTModel(
            config, spec, vocab_size=hf["vocab_size"] + case.vocab_pad, max_sequence_length=256,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
        )


@contextmanager
def mla_on_cpu(spec: Any) -> Iterator[None]:
    """Let megatron-core 0.16.1 build its MLA layers (local spec) on a machine without CUDA and
    Transformer Engine. Unpatched it fails three ways, none about a parameter:
    - the local `DotProductAttention` does not take the `k_channels`/`v_channels` MLA passes (only
      TE's attention does): the spec gets a parameter-free subclass that accepts them;
    - MLA's `RotaryEmbedding` ignores `use_cpu_initialization` and asks `torch.cuda.current_device()`;
    - megatron-core mocks an absent TE, MLA's module believes TE present and calls
      `isinstance(linear_proj, TELinear)` with the mock: it is told TE's real state."""
    from unittest import mock

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:  # Attention builds it without them first, MLA again with them
            super().__init__(*args, **kwargs)

    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = MLACoreAttention
    with mock.patch.object(mla, "HAVE_TE", te.HAVE_TE):
        if torch.cuda.is_available():
            yield
            return
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            yield


#: Megatron parameters whose rows are the (padded) vocabulary.
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def load_hf(model: Any, hf: dict[str, torch.Tensor], arch: str) -> None:
    """Write HF tensors into this rank's Megatron shards (the inverse of the source)."""
    from megatron.core import parallel_state as ps

    from p2psync.adapters.megatron.names import Split, canonical, table

    rules = table(arch)
    config = model.config
    local_experts = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    buffers = ((n, b) for n, b in model.named_buffers() if canonical(n).name in rules)  # a router's expert bias
    for name, param in chain(model.named_parameters(), buffers):
        canon = canonical(name)
        rule = rules[canon.name]
        layer = model.decoder.layers[canon.layer].layer_number - 1 if canon.layer is not None else None
        expert = None
        if canon.expert is not None:
            expert = ps.get_expert_model_parallel_rank() * local_experts + canon.expert
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        parts = [hf[t.format(layer=layer, expert=expert)] for t in rule.hf]
        if not getattr(param, "tensor_model_parallel", False):
            rank, size = 0, 1
        if canon.name in _VOCAB_PARAMS:  # Megatron's padding rows: zeros
            pad = param.shape[0] * size - parts[0].shape[0]
            parts = [torch.cat([parts[0], parts[0].new_zeros(pad, *parts[0].shape[1:])])]
        dim = getattr(param, "partition_dim", 0)
        if rule.split is Split.GATE_UP:  # stride 2: each shard is [gate_r; up_r]
            shard = torch.cat([p.chunk(size, 0)[rank] for p in parts], 0)
        elif rule.split is Split.QKV:
            groups, head_dim = config.num_query_groups, config.kv_channels
            q, k, v = (p.reshape(groups, -1, head_dim, *p.shape[1:]) for p in parts)
            full = torch.cat([q, k, v], 1).reshape(-1, *parts[0].shape[1:])
            shard = full.chunk(size, 0)[rank]
        else:
            shard = parts[0].chunk(size, dim)[rank]
        with torch.no_grad():
            param.copy_(shard)


def bridge_mapping_modules() -> None:
    """Make Megatron-Bridge's mapping modules importable. Bridge's package imports Transformer
    Engine (`peft/lora_layers.py`) though its mappings do not: where TE does not import, they are
    loaded without the package `__init__`s."""
    import importlib.util
    import sys
    import types

    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        spec = importlib.util.find_spec("megatron.bridge")
        assert spec is not None and spec.submodule_search_locations, "megatron-bridge is not installed"
        root = spec.submodule_search_locations[0]
        for package in ("", ".models", ".models.conversion", ".models.deepseek"):
            module = types.ModuleType(f"megatron.bridge{package}")
            module.__path__ = [root + package.replace(".", "/")]
            sys.modules[module.__name__] = module


def bridge_peft_modules() -> None:
    """Make Megatron-Bridge's LoRA (`peft/lora.py`) and its adapter export (`peft_bridge.py`)
    importable without Transformer Engine. Both import `transformer_engine.pytorch` at module
    level, for TE's linears only: while they import, a stand-in whose classes nothing is an
    instance of takes its place, so Bridge takes its Megatron-Core paths (`ColumnParallelLinear`,
    `RowParallelLinear`) as on a model built without TE, and is told TE's real state (it takes
    the mocks megatron-core puts in place of TE's linears for TE). Megatron-Core is imported first
    and the stand-in removed after, so no other code sees it."""
    import sys
    import types

    import megatron.core.dist_checkpointing.mapping
    import megatron.core.tensor_parallel
    import megatron.core.transformer.mlp
    import megatron.core.transformer.moe.moe_utils
    import megatron.core.transformer.moe.router  # noqa: F401

    bridge_mapping_modules()
    if "megatron.bridge.models.conversion.model_bridge" in sys.modules:
        return

    class _Stand(torch.nn.Module):
        """A Transformer Engine class: never instantiated here."""

    class _Ops(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (_Stand,), {})

    te = types.ModuleType("transformer_engine")
    te.__path__ = []
    te_torch = types.ModuleType("transformer_engine.pytorch")
    vars(te_torch).update(Linear=type("Linear", (_Stand,), {}), LayerNormLinear=type("LayerNormLinear", (_Stand,), {}),
                          ops=_Ops("transformer_engine.pytorch.ops"))
    vars(te).update(pytorch=te_torch)
    before = {name: sys.modules.get(name) for name in (te.__name__, te_torch.__name__)}
    sys.modules.update({te.__name__: te, te_torch.__name__: te_torch})
    try:
        import megatron.bridge.models.conversion.model_bridge
        import megatron.bridge.peft.lora  # noqa: F401
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    # megatron-core stands mocks in for TE's linears where TE is absent; Bridge takes them for TE
    from megatron.bridge.peft import utils
    from megatron.core.extensions import transformer_engine

    utils.HAVE_TE = transformer_engine.HAVE_TE


def bridge_lora(model: Any, *, dim: int, alpha: int, seed: int) -> Any:
    """`model` with Megatron-Bridge's own LoRA applied (`megatron.bridge.peft.lora.LoRA`, its
    default targets: every linear_qkv, linear_proj, linear_fc1 and linear_fc2), each adapter
    weight drawn from `seed` and this rank's TP and PP ranks (Bridge starts B at zeros, which
    would leave nothing to tell apart)."""
    from megatron.core import parallel_state as ps

    bridge_peft_modules()
    from megatron.bridge.peft.lora import LoRA

    model = LoRA(dim=dim, alpha=alpha)(model, training=True)
    where = ps.get_pipeline_model_parallel_rank() * 100 + ps.get_tensor_model_parallel_rank()
    generator = torch.Generator().manual_seed(seed * 10_000 + where)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    return model


def bridge_adapter_export(model: Any, registry: Any) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's own export of `model`'s LoRA adapters as HF PEFT tensors
    (`MegatronModelBridge.stream_adapter_weights_megatron_to_hf`, collective), converted by
    `registry` (the base weights' mappings), names as Bridge gives them (no PEFT prefix)."""
    bridge_peft_modules()
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    class Export(MegatronModelBridge):  # a model bridge of `registry`'s mappings
        def mapping_registry(self) -> Any:
            return registry

    return {name: tensor.clone() for name, tensor in Export().stream_adapter_weights_megatron_to_hf(
        model, cpu=True, show_progress=False)}


def bridge_deepseek_registry() -> Any:
    """Megatron-Bridge's own DeepSeek mapping registry (`deepseek/common.py`, the one that needs no
    model bridge class)."""
    bridge_mapping_modules()
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.deepseek.common import get_common_mapping_list

    return MegatronMappingRegistry(*get_common_mapping_list())


@contextmanager
def forward_on_cpu() -> Iterator[None]:
    """Megatron-Core 0.16.1's forward on CPU: it asks for the CUDA device, forks the CUDA RNG
    tracker (for dropout, here of probability 0), and its MoE router names `te_general_gemm`,
    which is unbound without Transformer Engine."""
    from unittest import mock

    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.moe import moe_utils

    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(CudaRNGStatesTracker, "fork", lambda self, *args, **kwargs: nullcontext()),
        mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True),
    ):
        yield


def logits_differ(model: Any, reference: Any, tolerance: float = 1e-5) -> str:
    """Why this rank's Megatron model (no pipeline parallelism; collective over its TP group) does
    not compute the logits of the transformers model `reference`, or "": its weights are the
    reference's in meaning, whatever name table placed them."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(1, 1, 12, 12, dtype=torch.bool).triu(1)  # True: masked
    with torch.no_grad(), forward_on_cpu():
        got = gather_from_tensor_model_parallel_region(model.eval()(ids, torch.arange(12)[None], causal))
        want = reference(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    return "" if diff < tolerance else f"Megatron's logits differ from transformers' by up to {diff}"
