"""Tiny random models for sglang tests: HF configs, checkpoint tensors, and sglang's own rank loads."""

from __future__ import annotations

import json
from typing import Any

import torch

from p2psync.worlds.oracles import SGLANG_FILL, sglang_loaded
from p2psync.core.types import ParamSpec, TargetParam, TargetTable

_COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
#: sglang's DeepSeek attention on CPU supports YaRN rotary embeddings only
DEEPSEEK_CPU_ROPE = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}


def add_deepseek_fields(cfg: Any) -> None:
    """Fields sglang (and vLLM) read that transformers' DeepseekV3Config lacks."""
    cfg.moe_layer_freq, cfg.topk_method, cfg.scoring_func, cfg.norm_topk_prob = 1, "noaux_tc", "sigmoid", True


#: A deep variant of a kind ("qwen3-deep"): enough decoder layers that layouts share compiled maps.
DEEP = "-deep"


def hf_config(kind: str) -> Any:
    """A tiny transformers config of `kind` (no download), in bfloat16; `<kind>-deep` has 5 layers."""
    import transformers

    common = {**_COMMON, "num_hidden_layers": 5} if kind.endswith(DEEP) else _COMMON
    kind = kind.removesuffix(DEEP)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, intermediate_size=96, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            num_key_value_heads=2, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        )
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, num_key_value_heads=4,
            q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            tie_word_embeddings=False, rope_parameters=DEEPSEEK_CPU_ROPE,
        )
        add_deepseek_fields(cfg)
    else:
        raise ValueError(kind)
    return as_checkpoint(cfg)


def as_checkpoint(cfg: Any) -> Any:
    """`cfg` as a bfloat16 checkpoint's config names it (its architecture)."""
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.torch_dtype = "bfloat16"
    return cfg


def config_dict(cfg: Any) -> dict[str, Any]:
    return json.loads(cfg.to_json_string(use_diff=False))


def hf_tensors(cfg: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under the HF checkpoint names of `cfg`'s model."""
    import tempfile

    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        import glob

        out: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(f"{d}/*.safetensors")):
            out.update(load_file(f))
    return {k: v.normal_() if v.is_floating_point() else v for k, v in out.items()}


def specs(tensors: dict[str, torch.Tensor]) -> dict[str, ParamSpec]:
    return {k: ParamSpec(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()}


def table_of(model: torch.nn.Module, key: dict[str, Any], rank: int, engine_id: str = "engine-0") -> TargetTable:
    """The table an endpoint would publish for `model` (no transport; addresses are not used)."""
    params = tuple(
        TargetParam(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), 0, p.numel() * p.element_size())
        for n, p in model.named_parameters()
    )
    return TargetTable(engine_id, rank, key["tp_size"], "sglang", key, "none", {}, "", params)


def sglang_rank(
    config: dict[str, Any], tp: int, ep: int, rank: int, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], TargetTable]:
    """What sglang itself holds on `rank` after loading `tensors` into parameters prefilled
    with `SGLANG_FILL` bytes, and the table that rank publishes. `config` is the HF config as a dict."""
    from p2psync.adapters.sglang.key import layout_key
    from p2psync.adapters.sglang.shim import hf_config_dict, require_sglang

    rank_model = sglang_loaded(config, tp, ep, rank, tensors)
    model_config = rank_model.model_config
    key = layout_key(rank_model.server_args, hf_config_dict(model_config), str(model_config.dtype), require_sglang())
    held = {name: p.data for name, p in rank_model.model.named_parameters()}
    return held, table_of(rank_model.model, key, rank)


def produce(layout: Any, tensors: dict[str, torch.Tensor], table: TargetTable) -> dict[str, torch.Tensor]:
    """Each parameter's bytes after writing every region `layout` produces into `SGLANG_FILL`-filled memory."""
    held = {p.name: torch.full((p.nbytes,), SGLANG_FILL, dtype=torch.uint8) for p in table.params}
    for group in layout.groups():
        out = torch.empty(group.nbytes, dtype=torch.uint8)
        for r in layout.fill(group, {n: tensors[n] for n in group.inputs}, out):
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = out[r.buffer_offset : r.buffer_offset + r.nbytes]
    return held
