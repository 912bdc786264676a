"""TrainerSource for Megatron-Bridge models: Bridge's own mapping registry converts.

Bridge's mappings (`QKVMapping`, `GatedMLPMapping`, ...) gather over TP, EP and
also broadcast each tensor from the pipeline stage that holds it to every stage,
so after a conversion every trainer rank holds the same HF tensors: the sender
group is the whole world, and every rank takes part in every conversion.
Construction runs one conversion pass (collective) to learn the HF names and
shapes from Bridge itself rather than from p2psync's own name table.

Gather-free (`local_shards`): where Bridge's mapping of a tensor is one of the conversions
`shards.place` describes (its column-, row-parallel and replicated mappings, also as
`AutoMapping` detects them; `QKVMapping`; `GatedMLPMapping`), each rank describes its part,
claimed as MegatronSource claims it (one copy per replicated part); ranks of other stages
hold nothing of it. Other mappings (permuted, KV-only, Mamba, gated attention output, a
norm that adds one) and experts are gathered: Bridge names experts only as Transformer
Engine's grouped modules, which do not build on CPU, so their description is untested.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core.source import LocalShard, TrainerSource
from ...core.types import ParamSpec, SenderGroup
from .convert import Heads
from .names import Split
from .shards import Placed, Sharding, claims, place
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
#: How one of Bridge's mappings converts a rank's tensor: its HF names, the sharding it undoes, the split.
_Described = tuple[tuple[str, ...], Sharding, Split]


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
        config = self._config = chunks[0].config
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
        self._grid = (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True))
        self._placed: dict[str, tuple[torch.Tensor, Placed]] | None = None
        self._unit_of: dict[str, _Unit] = {}
        self._specs: list[ParamSpec] = []
        for unit in self._units:
            for hf, t in self._convert(unit).items():
                self._unit_of[hf] = unit
                self._specs.append(ParamSpec(hf, tuple(t.shape), str(t.dtype).removeprefix("torch.")))

    def _mapping(self, unit: _Unit) -> Any:
        """Bridge's mapping of one unit, its wildcards resolved."""
        template, layer, expert = unit
        name = template.format(layer=layer, expert=self._ep_rank * self._local_experts + expert)
        mapping = self._registry.megatron_to_hf_lookup(name)
        if mapping is None:
            raise ValueError(f"Megatron-Bridge has no mapping for Megatron parameter {name!r}")
        return mapping

    def _convert(self, unit: _Unit) -> dict[str, torch.Tensor]:
        """Bridge's conversion of one unit (collective over every rank)."""
        param, module = self._local.get(unit, (None, None))
        return self._mapping(unit).megatron_to_hf(None if param is None else param.detach(), module)

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

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """This rank's part of each HF tensor of `names` whose mapping `describe` knows; nothing
        of the tensors of units other stages hold. The rest is left out, to be gathered."""
        import torch

        if self._placed is None:
            self._placed = self._placements()
        specs = {s.name: s for s in self._specs}
        out: dict[str, LocalShard] = {}
        for name in names:
            if name in self._placed:
                param, placed = self._placed[name]
                out[name] = LocalShard(placed.ranges, placed.values(param.detach()))
            elif self._unit_of[name] not in self._local:
                out[name] = LocalShard((), torch.empty(0, dtype=getattr(torch, specs[name].dtype)))
        return out

    def _placements(self) -> dict[str, tuple[torch.Tensor, Placed]]:
        """Per HF tensor of the units this rank holds that `describe` knows, what this rank claims."""
        import torch.distributed as dist

        specs = {s.name: s for s in self._specs}
        tp, replicas = self._grid
        config = self._config
        heads = Heads(config.num_attention_heads, config.num_query_groups or config.num_attention_heads,
                      config.kv_channels or config.hidden_size // config.num_attention_heads)
        out: dict[str, tuple[torch.Tensor, Placed]] = {}
        for index, unit in enumerate(self._units):
            if unit not in self._local:
                continue
            param, module = self._local[unit]
            described = describe(self._mapping(unit), param, module, config)
            if described is None:
                continue
            names, sharding, how = described
            dtype = str(param.dtype).removeprefix("torch.")
            if any(n not in specs or specs[n].dtype != dtype for n in names):
                continue
            rows = [specs[n].shape[0] if specs[n].shape else 0 for n in names]
            placed = place(tuple(param.shape), sharding, how, heads, rows)
            if placed is None:
                continue
            mine = claims(index, sharding.size > 1, dist.get_rank(tp), dist.get_world_size(tp),
                          dist.get_rank(replicas), dist.get_world_size(replicas))
            out.update((n, (param, p if mine else Placed.nothing())) for n, p in zip(names, placed))
        return out


def describe(mapping: Any, param: torch.Tensor, module: Any, config: Any) -> _Described | None:
    """How Bridge's (resolved) `mapping` turns this rank's `param` into HF tensors, where it is
    a conversion `shards.place` describes; None for any other (and for experts).
    `AutoMapping`'s own detection (`_detect_parallelism_type`, no collective) says which of
    the column, row or replicated mappings it delegates to: Bridge 0.3.1 has no public name
    for it."""
    from megatron.bridge.models.conversion import param_mapping as pm

    if mapping.is_expert:
        return None
    size = mapping.tp_size
    column = Sharding(0, 1, size, mapping.tp_rank) if size > 1 else Sharding()
    kind = type(mapping)
    if kind is pm.QKVMapping:
        gated = getattr(config, "attention_output_gate", False)
        if gated or mapping._tp_mapping._detect_parallelism_type(module) != "column":
            return None
        return tuple(mapping.hf_param[p] for p in "qkv"), column, Split.QKV
    if kind is pm.GatedMLPMapping:  # each shard is [gate_r; up_r]: stride 2
        gate_up = Sharding(0, 2, size, mapping.tp_rank) if size > 1 else column
        return (mapping.hf_param["gate"], mapping.hf_param["up"]), gate_up, Split.GATE_UP
    if kind is pm.AutoMapping and mapping.permute_dims is None:
        parallel = mapping._detect_parallelism_type(module)
    else:
        parallel = {pm.ColumnParallelMapping: "column", pm.RowParallelMapping: "row",
                    pm.ReplicatedMapping: "replicated", pm.DirectMapping: "replicated"}.get(kind)
    names = (str(mapping.hf_param),)
    if parallel == "column":
        return names, column, Split.COPY
    if parallel == "row":  # a row-parallel bias is not split
        return names, Sharding(1, 1, size, mapping.tp_rank) if size > 1 and param.dim() == 2 else Sharding(), Split.COPY
    if parallel == "replicated":
        return names, Sharding(), Split.COPY
    return None
