"""The two layouts of a vLLM target: replica and copy map.

Both start from the same compile step: rebuild the rank model on meta from the
layout key, find the parameter groups by running vLLM's loader on meta inputs,
and probe each group with index-coded inputs to learn exactly which elements
the loader writes (and, for the copy map, from where).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.errors import ConnectError, where
from ...core.layout import Layout, ParamGroup
from ...core.types import ParamSpec, Region, TargetParam, TargetTable, numel
from . import shim
from .copymap import Block, compile_blocks, replay, written_runs
from .model import LoaderRefused, RankModel, groups_of
from .probe import probe

if TYPE_CHECKING:
    import torch

#: Alignment of each parameter inside a group's part of the buffer (any dtype view starts aligned).
ALIGN = 64


@dataclass
class ParamPlan:
    """One engine parameter: where it sits in the group's buffer part, which of its
    elements the loader writes, and (when those are pure copies) the blocks that write them."""

    param: TargetParam
    slot: int
    runs: list[tuple[int, int]]
    blocks: list[Block] | None  # None: not a pure copy, produced by the replica

    def view(self, out: torch.Tensor) -> torch.Tensor:
        import torch

        return out[self.slot : self.slot + self.param.nbytes].view(getattr(torch, self.param.dtype))

    def regions(self) -> list[Region]:
        size = self.param.nbytes // max(1, numel(self.param.shape))
        return [Region(self.param.name, d * size, self.slot + d * size, n * size) for d, n in self.runs]


@dataclass
class GroupPlan:
    group: ParamGroup
    params: list[ParamPlan]


class VllmLayout(Layout):
    """The compiled groups of one vLLM target (layout key and rank); subclasses fill them."""

    def __init__(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> None:
        self.table = table
        self.model = RankModel(_vllm_config(table), table.rank)
        held = _check_params(table, self.model)
        specs = list(sources.values())
        try:
            feeds = self.model.feeds(specs)
        except LoaderRefused as exc:
            raise ConnectError(f"{where(table.engine_id, table.rank)}: {exc}") from exc
        missing = sorted(set(held) - {p for outs in feeds.values() for p in outs})
        if missing:
            raise ConnectError(
                f"{where(table.engine_id, table.rank, missing[0])}: no trainer HF tensor feeds it"
                + (f" (nor {len(missing) - 1} more parameters)" if len(missing) > 1 else "")
            )
        self.plans = [
            self._compile(ins, outs, sources, held) for ins, outs in groups_of(feeds, list(sources), list(held))
        ]
        self._by_key = {plan.group: plan for plan in self.plans}

    def _compile(
        self,
        inputs: Sequence[str],
        outputs: Sequence[str],
        sources: Mapping[str, ParamSpec],
        held: Mapping[str, TargetParam],
    ) -> GroupPlan:
        maps = probe(self.model, [sources[name] for name in inputs], outputs)
        starts, code = [], 0
        for name in inputs:
            starts.append((name, code))
            code += numel(sources[name].shape)
        params, slot = [], 0
        for name in outputs:
            element_map = maps[name]
            blocks = compile_blocks(element_map, starts) if element_map.pure else None
            params.append(ParamPlan(held[name], slot, written_runs(element_map), blocks))
            slot += (held[name].nbytes + ALIGN - 1) // ALIGN * ALIGN
        return GroupPlan(ParamGroup(tuple(inputs), tuple(outputs), slot), params)

    def groups(self) -> Sequence[ParamGroup]:
        return [plan.group for plan in self.plans]

    def _replica(
        self, plans: Sequence[ParamPlan], group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
    ) -> None:
        """vLLM's own loader writes `plans`' parameters (views into `out`); the group's other
        parameters stay on meta."""
        with self.model.materialized({p.param.name: p.view(out).view(p.param.shape) for p in plans}):
            self.model.load((name, tensors[name]) for name in group.inputs)


class ReplicaLayout(VllmLayout):
    """Every group is produced by vLLM's loader into the buffer."""

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        plan = self._by_key[group]
        self._replica(plan.params, group, tensors, out)
        return [r for p in plan.params for r in p.regions()]


class CopyMapLayout(VllmLayout):
    """Groups are replayed as strided copies; parameters whose bytes are not a pure copy of
    the inputs fall back to the replica, one parameter at a time. The rank model is kept
    only when some parameter needs it."""

    def __init__(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> None:
        super().__init__(table, sources)
        if all(p.blocks is not None for plan in self.plans for p in plan.params):
            self.model = None  # type: ignore[assignment]

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        plan = self._by_key[group]
        fallback = [p for p in plan.params if p.blocks is None]
        if fallback:
            self._replica(fallback, group, tensors, out)
        for p in plan.params:
            if p.blocks is not None:
                replay(p.blocks, tensors, p.view(out))
        return [r for p in plan.params for r in p.regions()]


def _vllm_config(table: TargetTable) -> Any:
    """The VllmConfig the layout key describes; ConnectError for what no layout reproduces."""
    key = table.layout_key
    problems = []
    if key.get("vllm") != shim.VLLM_VERSION:
        problems.append(f"engine runs vllm {key.get('vllm')}, layouts are pinned to {shim.VLLM_VERSION}")
    if key.get("quantization"):
        problems.append(f"quantization {key['quantization']!r} is not supported")
    if key.get("pp", 1) != 1 or key.get("dp", 1) != 1 or key.get("ep"):
        problems.append(
            f"only tensor parallelism is supported (pp={key.get('pp')}, dp={key.get('dp')}, ep={key.get('ep')})"
        )
    if key.get("tp") != table.world_size:
        problems.append(f"tp {key.get('tp')} differs from the engine's {table.world_size} ranks")
    if problems:
        raise ConnectError(f"{where(table.engine_id, table.rank)}: " + "; ".join(problems))
    return shim.engine_config(key["hf_config"], tp=key["tp"], dtype=key["dtype"])


def _check_params(table: TargetTable, model: RankModel) -> dict[str, TargetParam]:
    """The table's parameters, each checked against the rebuilt rank model."""
    held = {p.name: p for p in table.params}
    problems = []
    for name, param in model.params.items():
        p = held.get(name)
        expect = (tuple(param.shape), str(param.dtype).removeprefix("torch."))
        if p is None:
            problems.append(f"{where(table.engine_id, table.rank, name)} is not in its table")
        elif (p.shape, p.dtype) != expect:
            problems.append(
                f"{where(table.engine_id, table.rank, name)}: {list(p.shape)} {p.dtype} published, "
                f"{list(expect[0])} {expect[1]} rebuilt"
            )
    problems += [
        f"{where(table.engine_id, table.rank, n)} is not a parameter of the rebuilt model"
        for n in held
        if n not in model.params
    ]
    if problems:
        raise ConnectError("; ".join(problems))
    return {name: held[name] for name in model.params}
