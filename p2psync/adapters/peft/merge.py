"""Merge mode: a PEFT model's base weights with one LoRA adapter merged in, sent under the
base model's HF names into any engine (one without LoRA support too).

Each merged weight is what PEFT's own `merge_and_unload()` leaves: `W += B @ A * scaling`
(`get_delta_weight`: on CPU, half-precision A and B are multiplied in float32), added in
place in W's dtype. Merging has a cost in precision that adapter slots do not: in a bf16 W
the sum is rounded to W's grid, so a LoRA change smaller than half a unit in the last place
of an element is lost, and the merged update is not the trained one. Every merged weight
changes whenever the adapter does, so delta updates save little; merged weights are
computed from gathered W, A and B (the other base weights go gather-free as usual).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.source import LocalShard
from ..fsdp2.source import FSDP2Source, hf_name
from .lora import lora_config

if TYPE_CHECKING:
    import torch

#: What PEFT inserts into a wrapped model's parameter names.
_PEFT_PARTS = re.compile(r"^base_model\.model\.|\.base_layer(?=\.)")
_ANY_ADAPTER = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


def base_name(name: str) -> str:
    """A PEFT model's parameter name as the base model's checkpoint names it."""
    return _PEFT_PARTS.sub("", hf_name(name))


@dataclass(frozen=True)
class _Merge:
    """One base weight's adapter: its A and B parameters and PEFT's scaling and layout."""

    lora_a: Any
    lora_b: Any
    scaling: float
    fan_in_fan_out: bool


class MergedLoraSource(FSDP2Source):
    """The base weights of a PEFT model (FSDP2-sharded or whole) with adapter `adapter` merged
    into those it targets, under the base model's HF names; LoRA tensors are not sent."""

    name = "peft-merged"
    requires = ("peft", "torch.distributed.fsdp")

    def __init__(self, module: torch.nn.Module, *, adapter: str = "default", process_group: Any = None) -> None:
        config = lora_config(module, adapter)
        if config["use_dora"]:
            raise ValueError(f"LoRA adapter {adapter!r} is DoRA: merge mode merges plain LoRA only")
        if getattr(module.peft_config[adapter], "modules_to_save", None):  # type: ignore[index]
            raise ValueError(f"LoRA adapter {adapter!r} trains whole modules (modules_to_save): send them as "
                             "parameters of their own, not merged")
        super().__init__(module, name_map=base_name, select=lambda name: _ANY_ADAPTER.search(name) is None,
                         process_group=process_group)
        self.adapter = adapter
        self._merges = self._find_merges(module, adapter)

    def _find_merges(self, module: torch.nn.Module, adapter: str) -> dict[str, _Merge]:
        from peft.tuners.lora import Linear

        merges = {}
        for name, layer in module.named_modules():
            if adapter not in getattr(layer, "lora_A", {}) and adapter not in getattr(layer, "lora_embedding_A", {}):
                continue
            if not isinstance(layer, Linear):
                raise ValueError(f"LoRA adapter {adapter!r} on {name!r} ({type(layer).__name__}): merge mode merges "
                                 "LoRA of linear layers only")
            weight = base_name(f"{name}.base_layer.weight")
            if weight not in self._params:
                raise ValueError(f"LoRA adapter {adapter!r}: no base weight {weight!r} for {name!r}")
            merges[weight] = _Merge(layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                    float(layer.scaling[adapter]), bool(layer.fan_in_fan_out))
        if not merges:
            raise ValueError(f"LoRA adapter {adapter!r} targets no linear layer")
        return merges

    def gather_cast(self, names: Sequence[str], dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
        import torch

        merged = [n for n in names if n in self._merges]
        out = super().gather_cast([n for n in names if n not in self._merges], dtypes)
        bases = super().gather_cast(merged, {})
        for name in merged:
            weight = bases[name].clone()
            weight += _delta(self._merges[name])
            out[name] = weight.to(getattr(torch, dtypes[name])) if name in dtypes else weight
        return {name: out[name] for name in names}

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """Merged weights are computed from whole W, A and B: gathered, never sent from shards."""
        return super().local_shards([n for n in names if n not in self._merges])


def _delta(merge: _Merge) -> torch.Tensor:
    """PEFT's `get_delta_weight` on the full A and B."""
    import torch
    from torch.distributed.tensor import DTensor

    a, b = (p.detach().full_tensor() if isinstance(p.detach(), DTensor) else p.detach()
            for p in (merge.lora_a, merge.lora_b))
    dtype = b.dtype
    if b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    delta = b @ a
    delta = (delta.T if merge.fan_in_fan_out else delta) * merge.scaling
    return delta.to(dtype)
