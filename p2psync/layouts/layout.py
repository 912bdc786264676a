"""The layout of one engine rank, compiled from its rank model: copy map or replica.

Compiling:
1. the loader is traced once on meta (`trace`): which HF tensors feed which parameters,
   hence the groups, and, where it only moves data, its strided copies, at a cost in
   operations, not elements;
2. per group, traced copies are checked by probing (`probe`): the real loader runs on
   random inputs into parameters prefilled two ways, and the copies must write exactly the
   bytes it wrote (only those become regions: padding it leaves alone stays as the engine
   has it), bit for bit. A group repeating one structure (a fused parameter of many
   experts) is checked on its first, second and last instance, so that no check holds more
   than a few instances' inputs;
3. a group the trace cannot express, or whose check fails, is probed element by element:
   the loader runs on index-coded inputs, and each parameter whose elements are all copies
   or constants gets blocks, kept only if replaying them reproduces step 2's bytes. Any
   other parameter falls back to the replica: the engine's loader writes it, at each
   update, into the transfer buffer.
Groups of one structure across layers share a compiled map (`structures`). The rank model
is kept only while some parameter needs the loader.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.errors import ConnectError, where
from ..core.layout import CopyRun, Layout, ParamGroup, aligned
from ..core.types import ParamSpec, Region, TargetTable, numel
from .copymap import UNTOUCHED, Block, compile_blocks, replay, written_runs
from .probe import ElementMap, connected_groups, probe_elements, writes_like_loader, written_bytes
from .rank_model import ParameterHolders, RankModel
from .shard import block_runs
from .structures import compile_shared, renamed, sampled, structure_key, traced_once_per_layer
from .trace import LoaderTrace, trace_loader

log = logging.getLogger(__name__)

Mode = Literal["copy_map", "replica"]


@dataclass(frozen=True)
class _Slot:
    """Where one target parameter's bytes sit inside its group's bytes."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    def view(self, out: torch.Tensor) -> torch.Tensor:
        return out[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass
class _Param:
    """One parameter of a group: its slot, the regions the loader writes, and its blocks
    (None: produced by the engine's loader)."""

    slot: _Slot
    regions: list[Region]
    blocks: list[Block] | None


@dataclass
class _Group:
    group: ParamGroup
    params: list[_Param]
    traced: bool = False  # its copies came from the loader's trace, checked on random inputs

    @property
    def regions(self) -> list[Region]:
        return [r for p in self.params for r in p.regions]


class EngineLayout(Layout):
    """The bytes of one engine rank (layout key and rank), from the trainer's HF tensors.

    `mode` "copy_map": strided copies, the engine's loader only for parameters whose bytes
    are not copies of the inputs (per parameter); "replica": the engine's loader for every
    group. `together`: pairs of HF tensors to produce in one group (a quantized weight and its
    scale, which an engine's loader may read together); `trace`: `traced_loader` of these
    sources where the caller has traced them already. Raises ConnectError, naming engine,
    rank and parameter, for a table that disagrees with the rank model, a parameter no HF
    tensor feeds, or an HF tensor the loader refuses.
    """

    def __init__(
        self, table: TargetTable, sources: Mapping[str, ParamSpec], rank_model: RankModel, *, mode: Mode,
        together: Sequence[tuple[str, str]] = (), trace: LoaderTrace | None = None,
    ) -> None:
        self.table = table
        self._holders = ParameterHolders(rank_model.model)
        check_params(table, self._holders.params)
        if trace is None:
            trace = traced_loader(table, rank_model, self._holders.params, sources)
        feeds, self._mutated = trace.feeds, trace.mutated
        unloaded = rank_model.unloaded_params()
        self._left_alone = [name for name in self._holders.params if name in unloaded and name not in feeds]
        unfed = [name for name in self._holders.params if name not in feeds and name not in unloaded]
        if unfed:
            raise ConnectError(
                f"{where(table.engine_id, table.rank, unfed[0])}: no HF tensor of the trainer is loaded into it"
                + (f" (nor into {len(unfed) - 1} more)" if len(unfed) > 1 else "")
            )
        edges = [(hf, param) for param, hfs in feeds.items() for hf in hfs]
        # HF tensors produced together join through the parameters either feeds
        edges += [(b, param) for a, b in together for param, hfs in feeds.items() if a in hfs]
        instances = connected_groups(edges, list(sources), list(self._holders.params))
        compiled, shared = compile_shared(
            instances,
            lambda instance: structure_key(instance, sources, self._holders.params),
            lambda instance: self._compile(rank_model, [sources[n] for n in instance[0]], instance[1], mode, trace.copies),
            _renamed_group,
        )
        self._groups: dict[tuple[str, ...], _Group] = {g.group.outputs: g for g in compiled}
        self.shared_groups = shared  # compiled by renaming a group of the same structure
        self.traced_groups = sum(g.traced for g in compiled)  # compiled from the trace, not element probes
        self.rank_model: RankModel | None = rank_model if self.loader_params else None
        log.info(
            "%s: %d groups (%d shared with a group of the same structure, %d compiled from the loader's trace), "
            "%d parameters by the engine's loader",
            where(table.engine_id, table.rank), len(self._groups), shared, self.traced_groups, len(self.loader_params),
        )

    @property
    def loader_params(self) -> list[str]:
        """Parameters the engine's loader produces at every update (not a copy map)."""
        return [p.slot.name for g in self._groups.values() for p in g.params if p.blocks is None]

    def traced(self, group: ParamGroup) -> bool:
        """Whether `group` was compiled from the loader's trace (checked), not by element probes."""
        return self._groups[group.outputs].traced

    def regions_of(self, name: str) -> list[Region]:
        """The regions of parameter `name`, with buffer offsets relative to its group's bytes."""
        for group in self._groups.values():
            for p in group.params:
                if p.slot.name == name:
                    return p.regions
        raise KeyError(name)

    def groups(self) -> Sequence[ParamGroup]:
        return [g.group for g in self._groups.values()]

    def left_alone(self) -> Sequence[str]:
        return self._left_alone

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        compiled = self._groups[group.outputs]
        by_loader = {p.slot.name: p.slot.view(out) for p in compiled.params if p.blocks is None}
        if by_loader:
            rank_model, holders = self._loader()
            with holders.backed(by_loader):  # copies: a loader may change its input (Gemma's 1 + w)
                rank_model.load([(name, tensors[name].clone()) for name in group.inputs])
        flat = {name: tensors[name].contiguous().view(-1) for name in group.inputs}
        for p in compiled.params:
            if p.blocks is not None:
                replay(p.blocks, flat, p.slot.view(out).view(-1))
        return compiled.regions

    def reads(self, group: ParamGroup) -> dict[str, list[Block]] | None:
        """The blocks that read each input of `group` (an input they do not read is absent), or
        None where the engine's loader produces one of its parameters: it may read every element."""
        compiled = self._groups[group.outputs]
        if any(p.blocks is None for p in compiled.params):
            return None
        out: dict[str, list[Block]] = {}
        for p in compiled.params:
            for b in p.blocks or ():
                if b.source is not None:
                    out.setdefault(b.source, []).append(b)
        return out

    def copy_dtype(self, group: ParamGroup) -> str | None:
        compiled = self._groups[group.outputs]
        dtypes = {p.slot.dtype for p in compiled.params}
        if any(p.blocks is None for p in compiled.params) or len(dtypes) != 1:
            return None
        return str(dtypes.pop()).removeprefix("torch.")

    def copy_runs(self, group: ParamGroup, held: Mapping[str, Sequence[tuple[int, int]]]) -> list[CopyRun] | None:
        compiled = self._groups[group.outputs]
        if any(p.blocks is None for p in compiled.params):
            return None
        return [run for p in compiled.params for run in block_runs(p.slot.name, p.blocks or (), held)]

    def has_constants(self, group: ParamGroup) -> bool:
        return any(b.source is None for p in self._groups[group.outputs].params for b in p.blocks or ())

    def fill_constants(self, group: ParamGroup, out: torch.Tensor) -> list[Region]:
        compiled = self._groups[group.outputs]
        regions = []
        for p in compiled.params:
            constants = [b for b in p.blocks or () if b.source is None]
            replay(constants, {}, p.slot.view(out).view(-1))
            size = p.slot.dtype.itemsize
            regions += [Region(p.slot.name, b.dst_offset * size, p.slot.offset + b.dst_offset * size, b.sizes[0] * size) for b in constants]
        return regions

    # -- stored (see `stored`) -----------------------------------------------------------------

    _rebuild: Callable[[], RankModel]

    def compiled_groups(self) -> list[_Group]:
        """Its compiled groups: what `stored` keeps of it."""
        return list(self._groups.values())

    @classmethod
    def restored(
        cls, table: TargetTable, groups: Sequence[_Group], left_alone: Sequence[str], shared_groups: int,
        rank_model: Callable[[], RankModel],
    ) -> EngineLayout:
        """The layout of `table`'s unit compiled before, from its compiled groups: nothing is
        compiled. `rank_model` builds its rank model when a parameter the engine's loader produces
        is first filled (`rank_model` stays None until then), never where there is none."""
        layout = cls.__new__(cls)
        layout.table, layout.shared_groups, layout._left_alone = table, shared_groups, list(left_alone)
        layout._groups = {g.group.outputs: g for g in groups}
        layout.traced_groups = sum(g.traced for g in groups)
        layout.rank_model, layout._rebuild = None, rank_model
        return layout

    def _loader(self) -> tuple[RankModel, ParameterHolders]:
        """The rank model and its parameters' holders; a restored layout builds them at first use."""
        if self.rank_model is None:
            self.rank_model = self._rebuild()
            self._holders = ParameterHolders(self.rank_model.model)
        return self.rank_model, self._holders

    # -- compile ---------------------------------------------------------------------------

    def _compile(
        self, rank_model: RankModel, inputs: Sequence[ParamSpec], outputs: tuple[str, ...], mode: Mode,
        copies: Mapping[str, list[Block] | None],
    ) -> _Group:
        slots, nbytes = slots_of(self._holders.params, outputs)
        group = ParamGroup(tuple(s.name for s in inputs), outputs, nbytes)
        if mode == "copy_map":
            traced = [copies.get(name) for name in outputs]
            if all(blocks is not None for blocks in traced):
                checked = checked_group(
                    self.table, rank_model, self._holders, self._mutated, group, slots, inputs, traced,  # type: ignore[arg-type]
                )
                if checked is not None:
                    return checked
        return self._probed(rank_model, group, slots, inputs, mode)

    def _probed(
        self, rank_model: RankModel, group: ParamGroup, slots: Sequence[_Slot], inputs: Sequence[ParamSpec], mode: Mode
    ) -> _Group:
        """The group by probing its elements (copy map) or by the engine's loader (replica)."""
        outputs = group.outputs
        random = _random_inputs(inputs, outputs[0])
        reference, written = written_bytes(
            rank_model.load, self._holders, _viewer(slots), random, group.nbytes, self._mutated,
        )
        maps = None
        if mode == "copy_map":
            try:
                maps = probe_elements(rank_model.load, self._holders, inputs, outputs)
            except Exception as exc:  # a loader that refuses float64 inputs does not only copy
                log.debug("%s: index probe failed (%s); the engine's loader produces it", outputs, exc)
        codes, start = [], 0
        for spec in inputs:
            codes.append((spec.name, start))
            start += numel(spec.shape)
        flat = {name: t.contiguous().view(-1) for name, t in random}
        params = []
        for slot in slots:
            part = slice(slot.offset, slot.offset + slot.nbytes)
            regions = written_regions(slot, written[part])
            blocks = None
            if maps is not None and maps[slot.name].pure:
                blocks = self._verified_blocks(slot, maps[slot.name], codes, flat, reference[part], written[part])
            params.append(_Param(slot, regions, blocks))
        return _Group(group, params)

    def _verified_blocks(
        self, slot: _Slot, element_map: ElementMap, codes: Sequence[tuple[str, int]],
        flat: Mapping[str, torch.Tensor], reference: torch.Tensor, written: torch.Tensor,
    ) -> list[Block] | None:
        """`slot`'s blocks if replaying them writes exactly the bytes the loader wrote, else None."""
        blocks = compile_blocks(element_map.kind, element_map.source, element_map.value, codes)
        if blocks is None:
            return None
        size = slot.nbytes // max(1, element_map.kind.numel())
        covered = (element_map.kind != UNTOUCHED).repeat_interleave(size)
        replayed = torch.zeros(slot.nbytes, dtype=torch.uint8)
        replay(blocks, flat, replayed.view(slot.dtype))
        if torch.equal(covered, written) and torch.equal(replayed[written], reference[written]):
            return blocks
        log.debug("%s: its copies do not reproduce the loader's bytes", where(self.table.engine_id, self.table.rank, slot.name))
        return None


def slots_of(params: Mapping[str, torch.Tensor], outputs: Sequence[str]) -> tuple[list[_Slot], int]:
    """Where each of `outputs` sits in its group's bytes, and the group's size: one after another,
    each aligned."""
    slots, offset = [], 0
    for name in outputs:
        p = params[name]
        slots.append(_Slot(name, offset, tuple(p.shape), p.dtype, p.numel() * p.element_size()))
        offset += aligned(slots[-1].nbytes)
    return slots, offset


def written_regions(slot: _Slot, written: torch.Tensor) -> list[Region]:
    """The regions of `slot`'s parameter whose bytes the loader writes (`written`: a mask of them)."""
    return [Region(slot.name, s, slot.offset + s, n) for s, n in written_runs(written)]


def checked_group(
    table: TargetTable, rank_model: RankModel, holders: ParameterHolders, mutated: Collection[str],
    group: ParamGroup, slots: Sequence[_Slot], inputs: Sequence[ParamSpec], traced: Sequence[list[Block]],
) -> _Group | None:
    """The group from its traced copies if they write exactly what the real loader writes for
    random inputs (a sample of them where the group repeats one structure), else None. `mutated`:
    the inputs the loader changes in place."""
    covered = [_written_runs(blocks) for blocks in traced]
    if any(runs is None for runs in covered):
        log.debug("%s: its traced copies overlap", where(table.engine_id, table.rank, group.outputs[0]))
        return None
    has_constants = any(b.source is None for blocks in traced for b in blocks)
    sample = {s.name for s in inputs} if has_constants else sampled([s.name for s in inputs])
    checked = [[b for b in blocks if b.source is None or b.source in sample] for blocks in traced]
    random = _read_at_random([s for s in inputs if s.name in sample], [b for c in checked for b in c], group.outputs[0])
    flat = {name: t.view(-1) for name, t in random}

    def write(out: torch.Tensor) -> None:
        for slot, blocks in zip(slots, checked):
            replay(blocks, flat, slot.view(out).view(-1))

    if not writes_like_loader(rank_model.load, holders, _viewer(slots), random, group.nbytes, mutated, write):
        log.debug("%s: its traced copies differ from the loader", where(table.engine_id, table.rank, group.outputs[0]))
        return None
    params = []
    for slot, blocks, runs in zip(slots, traced, covered):
        size = slot.dtype.itemsize
        regions = [Region(slot.name, s * size, slot.offset + s * size, n * size) for s, n in runs or ()]
        params.append(_Param(slot, regions, blocks))
    return _Group(group, params, traced=True)


def _renamed_group(group: _Group, names: Mapping[str, str]) -> _Group:
    """`group` as the group of the same structure whose names `names` gives."""
    inputs, outputs = (tuple(names[n] for n in side) for side in (group.group.inputs, group.group.outputs))
    return _Group(
        ParamGroup(inputs, outputs, group.group.nbytes),
        [
            _Param(
                renamed(p.slot, names, ("name",)),
                [renamed(r, names, ("param",)) for r in p.regions],
                None if p.blocks is None else [renamed(b, names, ("source",)) for b in p.blocks],
            )
            for p in group.params
        ],
        group.traced,
    )


def _viewer(slots: Sequence[_Slot]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """What cuts a group's buffer into its parameters' views."""
    return lambda out: {s.name: s.view(out) for s in slots}


def _written_runs(blocks: Sequence[Block]) -> list[tuple[int, int]] | None:
    """(start, length) of the element runs `blocks` write, ascending and merged; None where two
    blocks write one element (the trace's writes then depend on their order)."""
    runs = []
    for b in blocks:
        if len(b.sizes) == 1 or b.dst_strides[0] == b.sizes[1]:  # rows back to back: one run
            runs.append((b.dst_offset, numel(b.sizes)))
        else:
            runs += [(b.dst_offset + row * b.dst_strides[0], b.sizes[1]) for row in range(b.sizes[0])]
    runs.sort()
    merged: list[tuple[int, int]] = []
    for start, n in runs:
        if merged and start < merged[-1][0] + merged[-1][1]:
            return None
        if merged and start == merged[-1][0] + merged[-1][1]:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        elif n:
            merged.append((start, n))
    return merged


class LoaderRefusal(ConnectError):
    """The engine's loader refuses HF tensor `tensor` (`cause`: what it raised)."""

    def __init__(self, message: str, tensor: str, cause: str) -> None:
        super().__init__(message)
        self.tensor, self.cause = tensor, cause


def traced_loader(
    table: TargetTable, rank_model: RankModel, params: Mapping[str, torch.Tensor], sources: Mapping[str, ParamSpec]
) -> LoaderTrace:
    """The engine's loader traced on meta (which HF tensors feed which parameter, and its
    copies); a LoaderRefusal naming the HF tensor the engine's loader refuses."""
    names = {*params, *sources}
    try:
        return traced_once_per_layer(
            lambda specs: trace_loader(rank_model.load, params, specs), list(sources.values()),
            lambda trace, layer, to: trace.layer_part(layer, to, names), LoaderTrace.merged,
        )
    except Exception:  # engines' loaders raise anything (asserts, shape errors) on a bad tensor
        for spec in sources.values():
            try:
                trace_loader(rank_model.load, params, [spec])
            except Exception as one:
                exc, culprit = one, spec
                break
        else:
            raise
        cause = f"{type(exc).__name__}: {exc}"
        raise LoaderRefusal(
            f"{where(table.engine_id, table.rank)}: {table.engine}'s loader refuses HF tensor {culprit.name!r} "
            f"{list(culprit.shape)} {culprit.dtype}: {cause}", culprit.name, cause,
        ) from exc


def check_params(table: TargetTable, params: Mapping[str, torch.Tensor]) -> None:
    """The table must publish exactly the parameters of the rebuilt rank model, with their
    shapes and dtypes; a ConnectError names every disagreement."""
    t, engine = table, table.engine
    published = {p.name: p for p in t.params}
    problems = []
    for name, param in params.items():
        p = published.get(name)
        dtype = str(param.dtype).removeprefix("torch.")
        if p is None:
            problems.append(f"{where(t.engine_id, t.rank, name)}: {engine}'s rank model has it, the engine did not publish it")
        elif (p.shape, p.dtype) != (tuple(param.shape), dtype):
            problems.append(
                f"{where(t.engine_id, t.rank, name)}: the engine has {list(p.shape)} {p.dtype}, "
                f"{engine}'s rank model {list(param.shape)} {dtype}"
            )
    problems += [
        f"{where(t.engine_id, t.rank, name)}: published, but not a parameter of {engine}'s rank model"
        for name in published
        if name not in params
    ]
    if problems:
        raise ConnectError("; ".join(problems))


def _generator(seed_name: str) -> torch.Generator:
    """Random numbers the same for the same group on every rank."""
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed_name.encode()).digest()[:4], "little"))


def _read_at_random(inputs: Sequence[ParamSpec], blocks: Sequence[Block], seed_name: str) -> list[tuple[str, torch.Tensor]]:
    """HF tensors in the trainer's dtypes, random where `blocks` read them and zero elsewhere.
    The zeros are untouched pages of an anonymous mapping: a rank that reads an eighth of an
    embedding holds an eighth of it. A loader reading other elements than the blocks do reads
    zeros where the blocks read random values, so the check still tells them apart."""
    generator = _generator(seed_name)
    reads: dict[str, list[Block]] = {}
    for b in blocks:
        if b.source is not None:
            reads.setdefault(b.source, []).append(b)
    out = []
    for spec in inputs:
        dtype, n = getattr(torch, spec.dtype), numel(spec.shape)
        pages = mmap.mmap(-1, max(1, n * dtype.itemsize))
        flat = torch.frombuffer(pages, dtype=dtype, count=n) if n else torch.empty(0, dtype=dtype)
        for b in reads.get(spec.name, ()):
            view = torch.as_strided(flat, b.sizes, b.src_strides, b.src_offset)
            view.copy_(torch.empty(b.sizes).uniform_(-2.0, 2.0, generator=generator))
        out.append((spec.name, flat.view(spec.shape)))
    return out


def _random_inputs(inputs: Sequence[ParamSpec], seed_name: str) -> list[tuple[str, torch.Tensor]]:
    """Random HF tensors in the trainer's dtypes, the same for the same group on every rank."""
    generator = _generator(seed_name)
    return [
        (s.name, torch.empty(s.shape).uniform_(-2.0, 2.0, generator=generator).to(getattr(torch, s.dtype)))
        for s in inputs
    ]
