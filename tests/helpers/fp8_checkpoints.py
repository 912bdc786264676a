"""Tiny fp8 checkpoints for the fp8 engine tests (sglang and vLLM): HF configs whose dimensions
are block multiples (hidden 256, head_dim 128, MoE shards of 128 rows at TP 2), their random
tensors, and the oracle: the fp8 checkpoint an engine's own loader is fed, quantized by the
named quantizer (tests/layouts/test_quantizers.py checks each against its public reference) from the
tensors each engine serves in fp8, listed here by name rather than derived from the engine."""

from __future__ import annotations

import glob
import json
import tempfile
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import pytest
import torch

from tests.helpers.sglang_models import DEEPSEEK_CPU_ROPE, add_deepseek_fields, as_checkpoint

from p2psync.core.types import ParamSpec
from p2psync.layouts import quantizers
from p2psync.layouts.quantizers import Quantizer

KINDS = ("qwen3", "qwen3_moe", "deepseek_v3")
_COMMON = dict(vocab_size=160, hidden_size=256, num_attention_heads=4, max_position_embeddings=128)


def hf_config(kind: str) -> Any:
    """A tiny transformers config of `kind` in bfloat16, unquantized."""
    import transformers

    if kind == "qwen3":
        cfg = transformers.Qwen3Config(
            **_COMMON, num_hidden_layers=1, intermediate_size=512, num_key_value_heads=2, head_dim=128,
            tie_word_embeddings=False,
        )
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **_COMMON, num_hidden_layers=1, intermediate_size=512, moe_intermediate_size=256, num_experts=4,
            num_experts_per_tok=2, num_key_value_heads=2, head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False,
        )
    elif kind == "deepseek_v3":
        # 8 heads: 2 per rank at TP 4, so q_b (2 x 128), kv_b (2 x 128) and o_proj (2 x 64) split in 64s
        cfg = transformers.DeepseekV3Config(
            **{**_COMMON, "num_attention_heads": 8}, num_hidden_layers=2, intermediate_size=512,
            moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=192,
            qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, tie_word_embeddings=False,
            rope_parameters=DEEPSEEK_CPU_ROPE,
        )
        add_deepseek_fields(cfg)
    else:
        raise ValueError(kind)
    return as_checkpoint(cfg)


def config_dict(kind: str, quantizer: Quantizer | None) -> dict[str, Any]:
    """`kind`'s HF config as a dict, with `quantizer`'s `quantization_config` (an fp8 checkpoint's)."""
    config = json.loads(hf_config(kind).to_json_string(use_diff=False))
    if quantizer is not None:
        config["quantization_config"] = quantizer.quantization_config()
    return config


def hf_tensors(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under the checkpoint names of `kind`'s model: every element random,
    each 64 x 64 tile of a matrix scaled by its own power of two in [2**-8, 2**8], so that blocks
    get different scales (power-of-two scales of unscaled normal blocks would all be equal, and a
    scale in the wrong place would go unseen)."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind), torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        names = {}
        for f in sorted(glob.glob(f"{d}/*.safetensors")):
            names.update(load_file(f))
    return {k: _tiled(torch.randn(v.shape, generator=generator), generator) for k, v in names.items()}


def _tiled(t: torch.Tensor, generator: torch.Generator, tile: int = 64) -> torch.Tensor:
    if t.dim() < 2:
        return t
    rows, cols = -(-t.shape[-2] // tile), -(-t.shape[-1] // tile)
    exponents = torch.randint(-8, 9, (rows, cols), generator=generator).to(torch.float32)
    factor = exponents.exp2().repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    return t * factor[: t.shape[-2], : t.shape[-1]]


def quantizer_of(name: str, block: int | None) -> Quantizer:
    """Quantizer `name` at a square `block` (None: per tensor)."""
    return quantizers.get(name, None if block is None else [block, block])


@lru_cache(maxsize=None)
def checkpoint(kind: str) -> dict[str, torch.Tensor]:
    """`hf_tensors(kind)`, made once per process."""
    return hf_tensors(kind)


def specs(tensors: dict[str, torch.Tensor]) -> dict[str, ParamSpec]:
    return {k: ParamSpec(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()}


def served_in_fp8(engine: str, kind: str, name: str) -> bool:
    """Whether `engine` serves HF tensor `name` of `kind` in fp8: every linear weight but the
    router gate, which vLLM quantizes in Qwen3-MoE (and not in DeepSeek-V3), sglang in neither."""
    if not name.endswith(("_proj.weight", "_proj_with_mqa.weight", "mlp.gate.weight")):
        return False
    if name.endswith("mlp.gate.weight"):
        return engine == "vllm" and kind == "qwen3_moe"
    return True


#: name, tensor -> the fp8 checkpoint's weight and scale (`Quantizer.quantize`, or a reference's).
Quantize = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def fp8_checkpoint(
    engine: str, kind: str, tensors: dict[str, torch.Tensor], quantize: Quantize
) -> dict[str, torch.Tensor]:
    """The fp8 checkpoint of `tensors` for `engine`: each tensor it serves in fp8 cast to bf16 (the
    engine's dtype) and quantized, the others as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if served_in_fp8(engine, kind, name):
            out.update(quantize(name, t.to(torch.bfloat16)))
        else:
            out[name] = t
    return out


def fill_bytes(params: dict[str, torch.Tensor], value: int) -> None:
    """Every byte of every parameter (0-d kv-cache scales too) set to `value`."""
    for p in params.values():
        p.reshape(-1).view(torch.uint8).fill_(value)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def fp8_row(engine: str, block: int | None) -> pytest.MarkDecorator:
    """The conformance row of an fp8 layout case: `engine` via its scale blocks."""
    return pytest.mark.conformance(engine=engine, via=f"fp8 block [{block}, {block}]" if block else "fp8 per-tensor")
