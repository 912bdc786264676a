"""Layouts of sglang ranks: sglang's own loaders on a storage-less rank model, or their copy map.

Both kinds start from sglang's model of the target rank built on the meta
device. Groups come from tracing its `load_weights` on meta inputs. Each group
is then run twice through the real loader, into buffers prefilled with two
different byte patterns: where either run changed a byte, the loader wrote it,
and only those bytes become regions. The copy map additionally probes the loader
with index-coded float64 inputs and compiles strided copies, kept for a
parameter only if replaying them reproduces the reference run bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...core.errors import ConnectError, where
from ...core.layout import Layout, ParamGroup
from ...core.relation import connected_groups
from ...core.session import ALIGN
from ...core.types import ParamSpec, Region, TargetTable
from .copymap import ParamMap, index_inputs, param_map, written_runs
from .key import rank_spec
from .probe import backed, trace_writes
from .shim import RankModel, build_rank_model

log = logging.getLogger(__name__)

MODES = ("copy_map", "replica")


@dataclass(frozen=True)
class _Slot:
    """Where one target parameter's bytes sit inside its group's bytes."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    def view(self, out: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return out[self.offset : self.offset + self.nbytes].view(dtype or self.dtype).view(self.shape)


@dataclass
class _Plan:
    """How one group's bytes are produced: a map per parameter, or None to run the loader."""

    group: ParamGroup
    slots: list[_Slot]
    regions: list[Region]
    maps: dict[str, ParamMap] | None


class SglangLayout(Layout):
    """The bytes of one sglang rank, from the trainer's HF tensors.

    `mode` is "copy_map" (default: strided copies, the loader only for parameters
    whose bytes are not a copy) or "replica" (sglang's loader for every group).
    """

    def __init__(self, table: TargetTable, sources: Mapping[str, ParamSpec], *, mode: str, version: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown sglang layout mode {mode!r}; choose one of {MODES}")
        self.table = table
        rank_model = build_rank_model(rank_spec(table, version), "meta")
        params = dict(rank_model.model.named_parameters())
        self._check_params(params)
        writes = self._trace(rank_model, params, sources)
        unwritten = [name for name in params if name not in writes]
        if unwritten:
            raise ConnectError(
                f"{where(table.engine_id, table.rank, unwritten[0])}: no HF tensor of the trainer is loaded into it"
                + (f" (nor into {len(unwritten) - 1} more)" if len(unwritten) > 1 else "")
            )
        self._plans: dict[tuple[str, ...], _Plan] = {}
        edges = ((hf, param) for param, hfs in writes.items() for hf in hfs)
        for inputs, outputs in connected_groups(edges, list(sources), list(params)):
            plan = self._compile(rank_model, params, [sources[n] for n in inputs], outputs, mode)
            self._plans[plan.group.outputs] = plan
        needs_loader = any(p.maps is None for p in self._plans.values())
        self._rank_model: RankModel | None = rank_model if needs_loader else None
        log.info(
            "%s: %d groups, %d produced by sglang's loader",
            where(table.engine_id, table.rank), len(self._plans), sum(p.maps is None for p in self._plans.values()),
        )

    @property
    def loader_params(self) -> list[str]:
        """Parameters whose bytes sglang's loader produces on every update (not a copy map)."""
        return [name for p in self._plans.values() if p.maps is None for name in p.group.outputs]

    def groups(self) -> Sequence[ParamGroup]:
        return [p.group for p in self._plans.values()]

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        plan = self._plans[group.outputs]
        if plan.maps is None:
            assert self._rank_model is not None
            with backed(self._rank_model.model, {s.name: s.view(out) for s in plan.slots}):
                self._rank_model.load([(name, tensors[name]) for name in group.inputs])
            return plan.regions
        sources = {name: tensors[name].contiguous() for name in group.inputs}
        for slot in plan.slots:
            plan.maps[slot.name].apply(sources, slot.view(out))
        return plan.regions

    def copy_dtype(self, group: ParamGroup) -> str | None:
        plan = self._plans[group.outputs]
        dtypes = {slot.dtype for slot in plan.slots}
        if plan.maps is None or len(dtypes) != 1:
            return None
        return str(dtypes.pop()).removeprefix("torch.")

    # -- compile ---------------------------------------------------------------------------

    def _trace(self, rank_model: RankModel, params: Mapping[str, torch.Tensor], sources: Mapping[str, ParamSpec]) -> dict[str, set[str]]:
        """Which HF tensors feed which parameter; a ConnectError naming the HF tensor sglang's loader refuses."""
        try:
            return trace_writes(rank_model.load, params, list(sources.values()))
        except Exception:  # sglang's loaders raise anything (asserts, shape errors) on a bad tensor
            for spec in sources.values():
                try:
                    trace_writes(rank_model.load, params, [spec])
                except Exception as one:
                    exc = one
                    culprit = f"HF tensor {spec.name!r} {list(spec.shape)} {spec.dtype}"
                    break
            else:
                culprit = "the trainer's HF tensors"
            raise ConnectError(
                f"{where(self.table.engine_id, self.table.rank)}: sglang's loader refuses {culprit}: {type(exc).__name__}: {exc}"
            ) from exc

    def _check_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """The table must list exactly the parameters of the rebuilt rank model."""
        t = self.table
        published = {p.name: p for p in t.params}
        for name, param in params.items():
            p = published.get(name)
            dtype = str(param.dtype).removeprefix("torch.")
            if p is None:
                raise ConnectError(f"{where(t.engine_id, t.rank, name)}: sglang's rank model has it, the engine did not publish it")
            if (p.shape, p.dtype) != (tuple(param.shape), dtype):
                raise ConnectError(
                    f"{where(t.engine_id, t.rank, name)}: the engine has {list(p.shape)} {p.dtype}, "
                    f"sglang's rank model {list(param.shape)} {dtype}"
                )
        extra = sorted(set(published) - set(params))
        if extra:
            raise ConnectError(f"{where(t.engine_id, t.rank, extra[0])}: published, but not a parameter of sglang's rank model")

    def _compile(
        self,
        rank_model: RankModel,
        params: Mapping[str, torch.nn.Parameter],
        inputs: Sequence[ParamSpec],
        outputs: tuple[str, ...],
        mode: str,
    ) -> _Plan:
        slots, offset = [], 0
        for name in outputs:
            p = params[name]
            nbytes = p.numel() * p.element_size()
            slots.append(_Slot(name, offset, tuple(p.shape), p.dtype, nbytes))
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        group = ParamGroup(tuple(s.name for s in inputs), outputs, offset)

        tensors = _random_inputs(inputs, outputs[0])
        reference, written = self._reference(rank_model, tensors, slots, offset)
        regions = [
            Region(s.name, start, s.offset + start, length)
            for s in slots
            for start, length in written_runs(written[s.offset : s.offset + s.nbytes])
        ]
        plan = _Plan(group, slots, regions, None)
        if mode == "copy_map":
            plan.maps = self._copy_map(rank_model, inputs, plan, dict(tensors), reference, written)
        return plan

    @staticmethod
    def _reference(
        rank_model: RankModel,
        tensors: Sequence[tuple[str, torch.Tensor]],
        slots: Sequence[_Slot],
        nbytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """sglang's bytes for `tensors`, and which bytes its loader writes."""
        runs = []
        for pattern in (0x00, 0xFF):
            out = torch.full((nbytes,), pattern, dtype=torch.uint8)
            with backed(rank_model.model, {s.name: s.view(out) for s in slots}):
                rank_model.load(tensors)
            runs.append(out)
        written = (runs[0] != 0x00) | (runs[1] != 0xFF)
        return runs[0], written

    def _copy_map(
        self,
        rank_model: RankModel,
        inputs: Sequence[ParamSpec],
        plan: _Plan,
        random_inputs: Mapping[str, torch.Tensor],
        reference: torch.Tensor,
        written: torch.Tensor,
    ) -> dict[str, ParamMap] | None:
        """Maps of every parameter of the group, or None if any is not copies and constants."""
        ranges, probe_inputs = index_inputs([(s.name, s.shape) for s in inputs])
        probed = {s.name: torch.full(s.shape, -1.0, dtype=torch.float64) for s in plan.slots}
        try:
            with backed(rank_model.model, probed):
                rank_model.load(list(probe_inputs.items()))
        except Exception as exc:  # a loader that refuses float64 is not a plain copy
            log.debug("%s: index probe failed (%s); using sglang's loader", plan.group.outputs, exc)
            return None
        replay = torch.zeros_like(reference)
        sources = {name: t.contiguous() for name, t in random_inputs.items()}
        maps: dict[str, ParamMap] = {}
        for slot in plan.slots:
            part = slice(slot.offset, slot.offset + slot.nbytes)
            size = slot.nbytes // max(1, _numel(slot.shape))
            elements = written[part].view(-1, size).any(1).view(slot.shape)
            found = param_map(probed[slot.name], slot.view(reference), elements, ranges)
            if found is not None:
                found.apply(sources, slot.view(replay))
            covered = elements.reshape(-1, 1).expand(-1, size).reshape(-1)
            if found is None or not (
                torch.equal(covered, written[part]) and torch.equal(replay[part][covered], reference[part][covered])
            ):
                log.debug("%s: not copies of the HF tensors; using sglang's loader", where(self.table.engine_id, self.table.rank, slot.name))
                return None
            maps[slot.name] = found
        return maps


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _random_inputs(inputs: Sequence[ParamSpec], seed_name: str) -> list[tuple[str, torch.Tensor]]:
    """Random HF tensors in the trainer's dtypes, the same for the same group on every rank."""
    seed = int.from_bytes(hashlib.sha256(seed_name.encode()).digest()[:4], "little")
    generator = torch.Generator().manual_seed(seed)
    return [(s.name, torch.randn(s.shape, generator=generator).to(getattr(torch, s.dtype))) for s in inputs]
