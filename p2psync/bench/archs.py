"""The connect bench's models: the planner's public architecture presets (no download), grown or
shrunk in layers, experts, hidden size and vocabulary, as an engine reads them (an HF config
dict) and as a trainer holds them (HF checkpoint names and shapes in float32, experts one by
one), and how their HF tensors split into the structures whose costs the bench fits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.types import ParamSpec, numel

#: The presets the connect bench compiles and extrapolates to (`p2psync.planner.presets`).
ARCHS = ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3", "Kimi-K2", "GLM-4.5-Air")
#: The HF config field holding the routed experts' count, by architecture family.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NUMBER = re.compile(r"\d+")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
#: The structures of a model's HF tensors: embeddings, final norm and head; each decoder
#: layer's tensors but its routed experts; the routed experts (each of each layer).
STRUCTURES = ("base", "layer", "expert")


@dataclass(frozen=True)
class Shape:
    """A preset with some of its sizes replaced (None: the preset's)."""

    arch: str
    layers: int | None = None
    experts: int | None = None
    hidden: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; choose from {', '.join(ARCHS)}")
        for name in ("layers", "experts", "hidden", "vocab"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, not {value}")

    @property
    def name(self) -> str:
        sizes = [f"{k}{v}" for k, v in (("L", self.layers), ("E", self.experts), ("H", self.hidden),
                                           ("V", self.vocab)) if v is not None]
        return "-".join([self.arch, *sizes])


def config(shape: Shape) -> dict[str, Any]:
    """The HF config of `shape`, as an engine reads it from a checkpoint's config.json (bfloat16)."""
    from transformers import AutoConfig

    from ..planner.presets import preset

    fields = preset(shape.arch)
    experts = next(k for k in _EXPERTS if k in fields)
    for key, value in (("num_hidden_layers", shape.layers), (experts, shape.experts), ("hidden_size", shape.hidden),
                       ("vocab_size", shape.vocab)):
        if value is not None:
            fields[key] = value
    if fields["num_experts_per_tok"] > fields[experts]:
        fields["num_experts_per_tok"] = fields[experts]
    for group in ("n_group", "topk_group"):  # DeepSeek's expert groups must divide the experts
        if group in fields and fields[experts] % fields[group]:
            fields[group] = 1
    return json.loads(AutoConfig.for_model(**fields).to_json_string(use_diff=False))


def hf_specs(hf_config: Mapping[str, Any]) -> dict[str, ParamSpec]:
    """The trainer's HF tensors of `hf_config`: checkpoint names and shapes in float32, from
    transformers' model on meta with its weight conversion reverted (experts one by one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = dict(hf_config)
    built = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built, dtype=torch.float32)
    tensors = revert_weight_conversion(model, model.state_dict())
    return {name: ParamSpec(name, tuple(t.shape), "float32") for name, t in tensors.items()}


def structure(name: str) -> str:
    """Which of `STRUCTURES` HF tensor `name` belongs to."""
    if _EXPERT.match(name):
        return "expert"
    return "layer" if _LAYER.match(name) else "base"


def group_structure(inputs: Any) -> str:
    """The structure a parameter group belongs to: expert if it reads a routed expert, else
    layer if it reads a decoder layer's tensor, else base."""
    return max((structure(name) for name in inputs), key=STRUCTURES.index, default="base")


def layer_of(group: Any) -> int | None:
    """The decoder layer a parameter group belongs to (the first its inputs name), None for a base group."""
    layers = [int(m[1]) for m in map(_LAYER.match, group.inputs) if m]
    return min(layers) if layers else None


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's HF tensor, None for any other."""
    match = _EXPERT.match(name)
    return None if match is None else (int(match[1]), int(match[2]))


def elements(specs: Mapping[str, ParamSpec], names: Any = None) -> dict[str, int]:
    """Elements of the HF tensors `names` (default all of `specs`), per structure."""
    out = dict.fromkeys(STRUCTURES, 0)
    for name in specs if names is None else names:
        out[structure(name)] += numel(specs[name].shape)
    return out


def experts(hf_config: Mapping[str, Any]) -> int:
    """The routed experts of each MoE layer."""
    return next(int(hf_config[k]) for k in _EXPERTS if k in hf_config)


def experts_per_rank(hf_config: Mapping[str, Any], engine: str, ep: int) -> int:
    """Routed experts of each layer whose HF tensors one engine rank loads: sglang places
    experts/ep on each expert-parallel rank, vLLM (tensor parallel only) every expert's shard on
    every rank."""
    return experts(hf_config) if engine == "vllm" else -(-experts(hf_config) // ep)


def instances(names: Any) -> dict[str, int]:
    """How many instances of each structure HF tensors `names` hold: one base, each decoder
    layer, each routed expert of each layer."""
    layers = {int(m[1]) for m in map(_LAYER.match, names) if m}
    return {"base": 1, "layer": len(layers), "expert": len({e for e in map(expert_of, names) if e is not None})}


def rank_structures(
    hf_config: Mapping[str, Any], specs: Mapping[str, ParamSpec], engine: str, ep: int
) -> dict[str, dict[str, int]]:
    """The instances and elements of each structure among the HF tensors one engine rank
    loads, as modelled: every base and layer tensor, `experts_per_rank` of each layer's routed
    experts."""
    share = experts_per_rank(hf_config, engine, ep), experts(hf_config)
    counts, sizes = instances(list(specs)), elements(specs)
    counts["expert"] = counts["expert"] * share[0] // share[1]
    sizes["expert"] = sizes["expert"] * share[0] // share[1]
    return {"instances": counts, "elements": sizes}


def template(inputs: Any) -> dict[str, int]:
    """A parameter group's inputs with every number masked (`model.layers.#.mlp.experts.#.up_proj.weight`),
    each masked name with how many inputs have it: the group's structure, which the same model at
    other sizes repeats (with its own count of local experts)."""
    out: dict[str, int] = {}
    for name in inputs:
        masked = _NUMBER.sub("#", name)
        out[masked] = out.get(masked, 0) + 1
    return out


def masked_sizes(specs: Mapping[str, ParamSpec]) -> dict[str, int]:
    """Elements of each masked HF name's tensors (equal for every layer and expert it stands for)."""
    sizes: dict[str, int] = {}
    for name, spec in specs.items():
        sizes.setdefault(_NUMBER.sub("#", name), numel(spec.shape))
    return sizes


def template_elements(tmpl: Mapping[str, int], sizes: Mapping[str, int], expert_scale: float) -> int | None:
    """Input elements of a group of structure `tmpl` in a model of `masked_sizes` `sizes`, its
    routed experts' count scaled by `expert_scale` (local experts there over here); None where
    that model has no such tensors."""
    if any(masked not in sizes for masked in tmpl):
        return None
    return round(sum(
        sizes[masked] * count * (expert_scale if structure(masked.replace("#", "0")) == "expert" else 1)
        for masked, count in tmpl.items()
    ))
