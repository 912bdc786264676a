"""TrainerSource for Megatron-Bridge models: Bridge's own mapping registry converts.

Bridge's mappings (`QKVMapping`, `GatedMLPMapping`, ...) gather over TP, EP and
also broadcast each tensor from the pipeline stage that holds it to every stage,
so after a conversion every trainer rank holds the same HF tensors: the sender
group is the whole world, and every rank takes part in every conversion.
Construction runs one conversion pass (collective) to learn the HF names and
shapes from Bridge itself rather than from p2psync's own name table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core.source import TrainerSource
from ...core.types import ParamSpec, SenderGroup
from .source import unwrap

if TYPE_CHECKING:
    import torch

INSTALL_HINT = (
    "the 'megatron-bridge' trainer source needs Megatron-Bridge: pip install 'p2psync[bridge]' "
    "(megatron-bridge==0.3.1 with its Transformer Engine, on a CUDA machine)"
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.experts\.local_experts\.|\.experts\.linear_fc\d\.(?:weight|bias))(\d+)")

#: A conversion unit: (name template with `{layer}`/`{expert}`, global layer, local expert index).
_Unit = tuple[str, int, int]


def registry_of(bridge: Any) -> Any:
    """Bridge's MegatronMappingRegistry for `bridge` (an AutoBridge, a model bridge, or a registry)."""
    try:
        import megatron.bridge  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT}; importing megatron.bridge failed: {exc}") from exc
    model_bridge = getattr(bridge, "_model_bridge", bridge)
    return model_bridge.mapping_registry() if hasattr(model_bridge, "mapping_registry") else bridge


def _template(name: str, layer_number: Any) -> tuple[str, int, int]:
    """(template, global layer, local expert) of a stage-local Megatron name."""
    layer = expert = -1
    if m := _LAYER.match(name):
        layer = layer_number(int(m.group(1)))
        name = "decoder.layers.{layer}." + name[m.end() :]
    if m := _EXPERT.search(name):
        expert = int(m.group(2))
        name = name[: m.start()] + m.group(1) + "{expert}" + name[m.end() :]
    return name, layer, expert


class BridgeSource(TrainerSource):
    """A Megatron-Core model (or its virtual-pipeline chunks) converted by Megatron-Bridge.

    `bridge` is the AutoBridge (or model bridge, or mapping registry) the trainer built
    the model with. Construct on every rank. A registry passed in must be made after
    `initialize_model_parallel`: Bridge's mappings take the parallel groups when made; made
    before, they see one pipeline stage and fail on the stages that lack the tensor."""

    name = "megatron-bridge"
    requires = ("megatron.bridge",)

    def __init__(self, model: Any | Sequence[Any], bridge: Any) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self._registry = registry_of(bridge)
        chunks = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
        config = chunks[0].config
        self._local_experts = (getattr(config, "num_moe_experts", None) or 0) // ps.get_expert_model_parallel_world_size()
        self._ep_rank = ps.get_expert_model_parallel_rank()
        self._local: dict[_Unit, tuple[Any, Any]] = {}
        for chunk in chunks:
            layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
            for name, param in chunk.named_parameters():
                unit = _template(name, lambda i, layers=layers: layers[i].layer_number - 1)
                self._local[unit] = (param, chunk.get_submodule(name.rpartition(".")[0]))  # Bridge reads its type
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(self._local))
        self._units = list(dict.fromkeys(u for units in everyone for u in units))
        self._group = SenderGroup("bridge", tuple(range(dist.get_world_size())), dist.get_rank())
        self._unit_of: dict[str, _Unit] = {}
        self._specs: list[ParamSpec] = []
        for unit in self._units:
            for hf, t in self._convert(unit).items():
                self._unit_of[hf] = unit
                self._specs.append(ParamSpec(hf, tuple(t.shape), str(t.dtype).removeprefix("torch.")))

    def _convert(self, unit: _Unit) -> dict[str, torch.Tensor]:
        """Bridge's conversion of one unit (collective over every rank)."""
        template, layer, expert = unit
        name = template.format(layer=layer, expert=self._ep_rank * self._local_experts + expert)
        mapping = self._registry.megatron_to_hf_lookup(name)
        if mapping is None:
            raise ValueError(f"Megatron-Bridge has no mapping for Megatron parameter {name!r}")
        param, module = self._local.get(unit, (None, None))
        return mapping.megatron_to_hf(None if param is None else param.detach(), module)

    def sender_group(self) -> SenderGroup:
        return self._group

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        for unit in dict.fromkeys(self._unit_of[n] for n in names):
            out.update((hf, t) for hf, t in self._convert(unit).items() if hf in wanted)
        return {n: out[n] for n in names}
