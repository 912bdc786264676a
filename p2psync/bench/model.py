"""The bench's Qwen3-MoE trainer model: the HF checkpoint's tensors under their own names, FSDP2-sharded.

transformers holds a MoE layer's experts fused (`mlp.experts.gate_up_proj`); trainers
export them per expert (`mlp.experts.3.gate_proj.weight`), which is what engines
load. The bench syncs without training, so its trainer holds exactly those HF
tensors: one FSDP2 unit per decoder layer and one for the rest.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Qwen3-MoE sizes: ~130M parameters for the bench, a tiny one for tests.
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "moe": dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512, num_hidden_layers=8,
        num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    ),
    "moe-tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _config(size: str) -> Any:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **MOE_CONFIGS[size], decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def hf_config(size: str) -> dict[str, Any]:
    """The HF config of `size`, as an engine reads it."""
    return json.loads(_config(size).to_json_string(use_diff=False))


def hf_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Every HF checkpoint tensor's name and shape, from transformers' model on meta
    with its weight conversion reverted (experts per expert, as saved)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(size))
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}


def _param_name(hf: str) -> str:
    """torch forbids '.' in a parameter's own name."""
    return hf.replace(".", "__")


def hf_tensors(size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 HF tensors of `size`'s Qwen3-MoE, the same for a seed on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in sorted(hf_shapes(size).items())}


def build(size: str, seed: int = 0) -> torch.nn.Module:
    """`hf_tensors` as parameters, one submodule per decoder layer."""
    import torch

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    rest = torch.nn.Module()
    layers: dict[int, torch.nn.Module] = {}
    for name, tensor in hf_tensors(size, seed).items():
        match = _LAYER.match(name)
        owner = rest if match is None else layers.setdefault(int(match[1]), torch.nn.Module())
        owner.register_parameter(_param_name(name), torch.nn.Parameter(tensor))
    for index in sorted(layers):
        root.layers.append(layers[index])
    root.rest = rest
    return root


def shard(model: torch.nn.Module) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_submodule("layers").children():
        fully_shard(layer)
    fully_shard(model)


def hf_name(param: str) -> str:
    """The HF name of a parameter of `build`'s module (`layers.0.model__layers__0__...`)."""
    return param.rpartition(".")[2].replace("__", ".")
