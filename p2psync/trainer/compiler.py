"""Compiling a connection: what this trainer rank sends, to whom, in which buckets.

Pure: target tables, the trainer's HF tensors, every rank's held shards and the
layouts in; the plan, the buckets, the work per bucket and the gather-free packings
out. No transport, no engine, no collective: every rank of a sender group computes
the same result from the same inputs, and a test can compile without starting anything.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.errors import ConnectError, where
from ..core.layout import ALIGN, Layout, ParamGroup, aligned
from ..core.types import ParamSpec, TargetId, TargetTable, numel
from .buckets import make_buckets
from .baseline import Slotted
from .gatherfree import Packing, compile_packing
from .plan import Plan, PlanTarget, build_plan, unit_of

#: Per HF tensor, the flat element ranges a rank holds (`TrainerSource.local_shards`).
HeldRanges = Mapping[str, Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class UnitWrites:
    """One unit (a layout key and rank: equal bytes) and the targets this rank writes its
    bytes to: the targets the plan gave this rank, or, for gather-free parts, every target
    of the unit (each rank writes its own part to all of them). `unit` names what delta
    mode keeps a baseline of: the layout unit, or for gather-free parts `own_shards(unit)`."""

    unit: str
    layout: Layout
    targets: tuple[TargetTable, ...]


@dataclass
class Compiled:
    """What one trainer rank does in every update of a connection."""

    plan: Plan
    buckets: list[list[str]]
    #: Per bucket, the units this rank produces from its tensors, with their groups.
    work: list[list[tuple[UnitWrites, list[ParamGroup]]]]
    #: Gather-free: per unit, this rank's packings of its own shards.
    packed: list[tuple[UnitWrites, list[Packing]]]
    #: HF tensors gathered cast to a narrower dtype.
    gather_dtypes: dict[str, str]
    #: Every target this rank writes to (its peers).
    targets: set[TargetId] = field(default_factory=set)
    #: Where this rank gathers what it was asked to send gather-free, in words.
    degraded: list[str] = field(default_factory=list)
    #: Which share of every target's patch area this rank's patches use: (index, count).
    patch_share: tuple[int, int] = (0, 1)
    #: Per unit this rank produces (gathered, and its own gather-free parts): its targets,
    #: and its groups or packings in sending order (what delta mode keeps baselines of);
    #: derived from `work` and `packed` once.
    served: dict[str, tuple[list[TargetTable], list[Slotted]]] = field(init=False)

    def __post_init__(self) -> None:
        self.served = {}
        for writes, packings in self.packed:
            self.served[writes.unit] = (list(writes.targets), [p.slot for p in packings])
        for work in self.work:
            for writes, groups in work:
                self.served.setdefault(writes.unit, (list(writes.targets), []))[1].extend(groups)

    def buffer_bytes(self, bucket_bytes: int) -> int:
        """The size each transfer buffer needs: a bucket's groups of one unit, but never less
        than its largest group."""
        need = ALIGN
        sizes = [[g.nbytes for g in groups] for units in self.work for _, groups in units]
        sizes += [[p.nbytes for p in packings] for _, packings in self.packed if packings]
        for nbytes in sizes:
            largest = max(aligned(n) for n in nbytes)
            need = max(need, min(sum(aligned(n) for n in nbytes), max(bucket_bytes, largest)))
        return need

    @property
    def largest_group_bytes(self) -> int:
        return max((g.nbytes for units in self.work for _, groups in units for g in groups), default=0)

    def step_bytes(self) -> list[int]:
        """The bytes this rank produces in each step of an update: each unit it sends
        gather-free, then each bucket it gathers."""
        packed = [sum(p.nbytes for p in packings) for _, packings in self.packed]
        return packed + [sum(g.nbytes for _, groups in units for g in groups) for units in self.work]

    @property
    def gather_free_bytes(self) -> tuple[int, int]:
        """Bytes of one update sent gather-free, and produced from gathered tensors (per unit)."""
        free = sum(r.nbytes for _, packings in self.packed for p in packings for r in p.regions)
        gathered = sum(g.nbytes for units in self.work for _, groups in units for g in groups)
        return free, gathered


@dataclass(frozen=True)
class SenderView:
    """What the compiler knows of the trainer: this rank, its sender group's ranks (the
    group's first rank packs constants), every HF tensor of the group and how buckets split."""

    rank: int
    group_ranks: tuple[int, ...]
    specs: Mapping[str, ParamSpec]
    bucket_bytes: int
    bucket_kind: Callable[[str], str]


def compile_connection(
    tables: Mapping[str, Sequence[TargetTable]],
    layouts: Mapping[str, Layout],
    sender: SenderView,
    held: Sequence[HeldRanges] = (),
) -> Compiled:
    """Compile `tables` (per engine) with `layouts` (per unit: `unit_of(key, rank)`);
    `held`: every world rank's held ranges (empty: everything is gathered)."""
    every = [t for engine_tables in tables.values() for t in engine_tables]
    units: dict[str, TargetTable] = {}  # unit -> its first table: the parameters
    for t in every:
        units.setdefault(unit_of(t.layout_key_text, t.rank), t)
    groups_of = {unit: _own_groups(table, layouts[unit], sender.specs) for unit, table in units.items()}

    packed = _gather_free(units, groups_of, layouts, sender, held)
    groups_of = {u: [g for g in gs if g not in packed.get(u, {})] for u, gs in groups_of.items()}
    degraded = _gathered_instead(groups_of, layouts) if any(held) else []
    plan = build_plan(
        sender.group_ranks,
        [
            PlanTarget(t.target, unit, sum(g.nbytes for g in groups_of[unit]))
            for t in every
            if groups_of[unit := unit_of(t.layout_key_text, t.rank)]
        ],
    )
    planned = set(plan.targets_of(sender.rank))
    targets = set(planned)
    packed_writes = []
    for unit, packings in packed.items():
        nonempty = [p for p in packings.values() if p.nbytes]
        if nonempty:
            of_unit = tuple(t for t in every if unit_of(t.layout_key_text, t.rank) == unit)
            packed_writes.append((UnitWrites(own_shards(unit), layouts[unit], of_unit), nonempty))
            targets.update(t.target for t in of_unit)

    served: dict[str, list[TargetTable]] = defaultdict(list)
    for t in every:
        if t.target in planned:
            served[unit_of(t.layout_key_text, t.rank)].append(t)
    reads = [(layouts[u], g) for u, gs in groups_of.items() for g in gs]
    buckets = make_buckets(list(sender.specs.values()), [g for _, g in reads], sender.bucket_bytes, sender.bucket_kind)
    bucket_of = {name: i for i, names in enumerate(buckets) for name in names}
    work: list[list[tuple[UnitWrites, list[ParamGroup]]]] = [[] for _ in buckets]
    for unit, unit_targets in served.items():
        writes = UnitWrites(unit, layouts[unit], tuple(unit_targets))
        per_bucket: dict[int, list[ParamGroup]] = defaultdict(list)
        for group in groups_of[unit]:
            per_bucket[bucket_of[group.inputs[0]]].append(group)
        for i, groups in sorted(per_bucket.items()):
            work[i].append((writes, groups))
    return Compiled(
        plan=plan,
        buckets=buckets,
        work=work,
        packed=packed_writes,
        gather_dtypes=narrower_dtypes(sender.specs, reads),
        targets=targets,
        degraded=degraded,
        # Gather-free, every rank may patch a target at once: each gets its own share of the area.
        patch_share=(sender.rank, len(held)) if any(held) else (0, 1),
    )


def own_shards(unit: str) -> str:
    """What a rank's gather-free parts of `unit` are named by: their baseline is apart from
    the gathered groups' (other bytes, other targets)."""
    return f"{unit} (own shards)"


def _gathered_instead(gathered: Mapping[str, list[ParamGroup]], layouts: Mapping[str, Layout]) -> list[str]:
    """Why the groups left to gather are not sent gather-free."""
    computed = [g for u, gs in gathered.items() for g in gs if layouts[u].copy_runs(g, {}) is None]
    unheld = [g for gs in gathered.values() for g in gs if g not in computed]
    notes = []
    for groups, why in [
        (unheld, "their HF tensors are not held exactly once across the sender group's ranks"),
        (computed, "the engine's loader computes their bytes (not copies of the trainer's tensors)"),
    ]:
        if groups:
            notes.append(
                f"gather-free: {len(groups)} parameter group(s) over the engine ranks gathered instead "
                f"(e.g. {groups[0].outputs[0]!r}): {why}"
            )
    return notes


def _own_groups(table: TargetTable, layout: Layout, specs: Mapping[str, ParamSpec]) -> list[ParamGroup]:
    """The groups of `layout` whose inputs this rank's sender group holds."""
    own = []
    for group in layout.groups():
        held = [name in specs for name in group.inputs]
        if all(held):
            own.append(group)
        elif any(held):
            raise ConnectError(
                f"{where(table.engine_id, table.rank, group.outputs[0])} needs HF tensors "
                f"{list(group.inputs)}, which are split across sender groups"
            )
    return own


def _gather_free(
    units: Mapping[str, TargetTable],
    groups_of: Mapping[str, list[ParamGroup]],
    layouts: Mapping[str, Layout],
    sender: SenderView,
    every_rank: Sequence[HeldRanges],
) -> dict[str, dict[ParamGroup, Packing]]:
    """Per unit, the packings of the groups this rank sends without a gather: groups of
    copies (`Layout.copy_runs`) whose inputs the sender group holds in parts that cover
    each tensor exactly once."""
    if not every_rank:
        return {}
    ranges = every_rank[sender.rank]
    held = held_once(every_rank, sender.group_ranks, sender.specs)
    out: dict[str, dict[ParamGroup, Packing]] = {}
    for unit, groups in groups_of.items():
        layout = layouts[unit]
        params = {p.name: p for p in units[unit].params}
        for group in groups:
            if not set(group.inputs) <= held or layout.copy_runs(group, {}) is None:
                continue
            inputs = {n: ranges[n] for n in group.inputs}
            constants = sender.rank == sender.group_ranks[0]
            out.setdefault(unit, {})[group] = compile_packing(layout, group, inputs, params, constants)
    return out


def held_once(every_rank: Sequence[HeldRanges], ranks: Sequence[int], specs: Mapping[str, ParamSpec]) -> set[str]:
    """The HF tensors whose parts, over `ranks` (`every_rank`: each world rank's held
    ranges), cover every element exactly once: only those may go gather-free."""
    out = set()
    for name in every_rank[ranks[0]] if ranks else ():
        if name not in specs:
            continue
        spans: list[tuple[int, int]] = []
        for rank in ranks:
            if name not in every_rank[rank]:
                break
            spans += [(int(start), int(end)) for start, end in every_rank[rank][name]]
        else:
            spans.sort()
            ends = [0] + [end for _, end in spans]
            if all(start == end for (start, _), end in zip(spans, ends)) and ends[-1] == numel(specs[name].shape):
                out.add(name)
    return out


def narrower_dtypes(specs: Mapping[str, ParamSpec], reads: Sequence[tuple[Layout, ParamGroup]]) -> dict[str, str]:
    """HF tensors to gather in a narrower dtype: those that every group reading them only
    copies into parameters of one dtype (`Layout.copy_dtype`) with fewer bytes per
    element than the trainer's. Every rank of a sender group computes the same map."""
    import torch

    wanted: dict[str, set[str | None]] = defaultdict(set)
    for layout, group in reads:
        dtype = layout.copy_dtype(group)
        for name in group.inputs:
            wanted[name].add(dtype)
    out = {}
    for name, dtypes in wanted.items():
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype is not None and getattr(torch, dtype).itemsize < getattr(torch, specs[name].dtype).itemsize:
            out[name] = dtype
    return out
