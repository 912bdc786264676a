"""The sender's side of delta updates: which targets get a delta, what changed, and the
patches staged for them.

A target's bytes equal its unit's baseline only if it acknowledged the update that
produced the baseline. So every trainer rank tracks, per target, the update it
holds (the session's own count of updates): set when an update leaves its engine
resumed (written, checked when `check` is on, finished), dropped when the engine
failed, and forgotten when the target publishes another table (restarted,
re-registered) or is not connected. At each update a target gets a delta when
delta mode is on, no full update is due, its table has a patch area and the update
it holds is the one its unit's baseline holds; otherwise it gets the full bytes,
which re-seed it. The baselines are re-seeded by every update either way.

For the delta targets of a unit, each region the layout produced is compared with
the baseline in chunks that fit the engine's patch area; a chunk goes dense (a
plain write into the parameter, like a full update) or sparse (its pieces staged
into a patch buffer, written into the engine's patch area and applied by the
engine before the next patch lands there).

A unit is what one rank produces for a layout unit: its gathered groups, or its own
gather-free parts (`compiler.own_shards`), whose baseline holds exactly the bytes this
rank packs. As every rank of a sender group then writes patches to the same targets,
each rank patches only its share of every patch area (`Compiled.patch_share`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from . import collectives
from .baseline import BaselineStore, Slotted
from .buffers import BufferPool, Lease
from .options import DeltaOptions
from ..core.delta import (
    MAX_RECORD_ELEMENTS,
    Change,
    Kind,
    PatchRecord,
    diff,
    element_size_for,
    elements,
    piece,
    record_bytes,
)
from ..core.errors import where
from ..core.layout import ALIGN
from ..core.types import Region, TargetId, TargetTable, dtype_size

if TYPE_CHECKING:
    import torch

    from ..core.report import UpdateReport
    from ..core.transport import Transport

#: Per unit a sender serves: its tables and its groups (or packings) in sending order.
Served = Mapping[str, tuple[Sequence[TargetTable], Sequence[Slotted]]]
#: Which share of every patch area a sender patches: (its index, how many shares).
Share = tuple[int, int]
#: Per engine, per rank: the version it holds and why its weights may differ from that update's.
Held = Mapping[str, Mapping[int, tuple[str | None, str | None]]]


@dataclass
class StagedPatch:
    """Patch records of one unit staged in a patch buffer; written to every delta target
    of the unit (into its patch area at offset 0), then applied there."""

    unit: str
    lease: Lease
    nbytes: int = 0
    records: list[PatchRecord] = field(default_factory=list)


@dataclass
class DeltaStats:
    """What delta mode did in one update on one sender."""

    targets: list[TargetId] = field(default_factory=list)
    changed: int = 0
    compared: int = 0
    over_budget: int = 0  # units without a baseline: the memory budget is too small
    altered: dict[TargetId, str] = field(default_factory=dict)  # sent in full: changed outside p2psync


class DeltaSender:
    """Delta state of one trainer rank: baselines, the update each target holds, patch buffers.

    `acquire_timeout` bounds the wait for a free patch buffer, after which `on_stall`
    may fail the engines holding them (as for transfer buffers).
    """

    def __init__(
        self,
        options: DeltaOptions,
        *,
        device: str,
        pin_memory: bool,
        acquire_timeout: float,
        on_stall: Callable[[float], None],
    ) -> None:
        self.options = options
        self.device = device
        self.pin_memory = pin_memory  # the patch buffers', like the transfer buffers'
        # Baselines are copied to the device to be compared only where the buffers live there.
        self.store = BaselineStore(options.memory_bytes, pin_memory=device != "cpu")
        self.acquire_timeout = acquire_timeout
        self.on_stall = on_stall
        self.stats = DeltaStats()
        self._pool: BufferPool | None = None
        self._tables: dict[TargetId, TargetTable] = {}
        self._held: dict[TargetId, tuple[int, str]] = {}  # the update (count, version) a target holds
        self._served: dict[str, list[TargetTable]] = {}
        self._elem: dict[str, dict[str, int]] = {}
        self._delta: set[tuple[str, TargetId]] = set()  # (unit, target): a target may get two units
        self._open: StagedPatch | None = None
        self._ready: list[StagedPatch] = []
        self._updates = 0
        self._version = ""
        self._share: Share = (0, 1)

    # -- connect ---------------------------------------------------------------------------

    def pool_for(
        self, served: Served, share: Share, current: BufferPool | None, transport: Transport
    ) -> BufferPool | None:
        """Patch buffers for the units `served` (see `connect`): `current` if it fits the
        smallest `share` of a patch area among their targets, else new ones (None: no
        target has one). Changes nothing here, so that a connect refused later leaves this
        sender as it was."""
        areas = [_share_bytes(t.patch_area[1], share) for unit_tables, _ in served.values() for t in unit_tables
                 if t.patch_area]
        capacity = min(areas, default=0)
        if not capacity:
            return None
        if current is not None and current.nbytes == capacity:
            return current
        return BufferPool(capacity, transport, device=self.device, pin_memory=self.pin_memory)

    def connect(
        self, tables: Mapping[str, Sequence[TargetTable]], served: Served, share: Share, pool: BufferPool | None
    ) -> None:
        """Every engine's tables, per unit this rank serves its tables and groups in
        sending order, its share of the patch areas, and the patch buffers (from
        `pool_for`; the connection owns them). A target whose table changed is no longer
        known to hold anything."""
        current = {t.target: t for engine_tables in tables.values() for t in engine_tables}
        for target in list(self._held):
            if target not in current or current[target] != self._tables.get(target):
                del self._held[target]
        self._tables = current
        self._served = {unit: list(unit_tables) for unit, (unit_tables, _) in served.items()}
        self._elem = {
            unit: {p.name: dtype_size(p.dtype) for p in unit_tables[0].params}
            for unit, (unit_tables, _) in served.items()
        }
        self.store.configure({unit: list(groups) for unit, (_, groups) in served.items()})
        self._share = share
        self._pool = pool

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the registered patch buffers."""
        return self._pool.nbytes * len(self._pool.tensors) if self._pool else 0

    # -- update ----------------------------------------------------------------------------

    def begin(self, full: bool, version: str, held: Held) -> None:
        """Decide which served targets get a delta in the update to `version` (before any
        baseline changes). A target whose engine says (`held`) that it holds another version
        than this sender's last update to it (another writer updated it), or that its weights
        changed since, holds no baseline any more: it gets its full bytes."""
        due = self.options.full_every > 0 and self._updates % self.options.full_every == 0
        self._updates += 1
        self._version = version
        self._delta = set()
        changed = self._unproven(held)
        for target in changed:
            self._held.pop(target, None)
        if not (full or due) and self._pool is not None:
            for unit, unit_tables in self._served.items():
                base = self.store.update_of(unit)
                for table in unit_tables:
                    holds = self._held.get(table.target)
                    if table.patch_area is not None and base is not None and holds is not None and holds[0] == base:
                        self._delta.add((unit, table.target))
        left_out = self.store.start_update()
        targets = sorted({target for _, target in self._delta}, key=str)
        self.stats = DeltaStats(targets=targets, over_budget=len(left_out), altered=changed)

    def _unproven(self, held: Held) -> dict[TargetId, str]:
        """The targets believed to hold an update of this sender's whose engine says otherwise."""
        out = {}
        for target, (_, version) in self._held.items():
            says = held.get(target.engine_id, {}).get(target.rank)
            if says is None:  # the engine cannot tell (or was not asked): trusted
                continue
            engine_version, why = says
            if why is not None:
                out[target] = why
            elif engine_version != version:
                out[target] = (f"it holds version {engine_version!r}, not {version!r} of this session's baseline "
                               "(another session or trainer updated it)")
        return out

    def is_delta(self, unit: str, target: TargetId) -> bool:
        return (unit, target) in self._delta

    def diff(
        self, unit: str, group: Slotted, out: torch.Tensor, written: Sequence[Region], offset: int
    ) -> list[Region]:
        """Compare `group`'s bytes in `out` (regions `written`, whose buffer offsets are
        `offset` past `out`'s start) with the baseline, stage the sparse chunks and
        return the dense ones, for the unit's delta targets; re-seed the baseline. In host
        memory only what changed is written back into it; a device compares a copy of it,
        and the baseline then takes the group's bytes whole."""
        base = self.store.slot(unit, group)
        if base is None:
            return list(written)
        if not any((unit, t.target) in self._delta for t in self._served[unit]):
            base.copy_(out[: group.nbytes])
            return []
        dense: list[Region] = []
        on_host = out.device.type == "cpu"
        old_all = base if on_host else base.to(out.device, non_blocking=True)
        for r in written:
            start = r.buffer_offset - offset
            elem = element_size_for(self._elem[unit][r.param], r.param_offset, r.nbytes, start)
            step = self._chunk_bytes(elem)
            for done in range(0, r.nbytes, step):
                n = min(step, r.nbytes - done)
                new, old = out[start + done : start + done + n], old_all[start + done : start + done + n]
                change = diff(new, old, elem)
                self.stats.compared += n // elem
                if change is None:
                    continue
                self.stats.changed += change.changed
                if change.kind == "dense":
                    dense.append(Region(r.param, r.param_offset + done, r.buffer_offset + done, n))
                else:
                    self._stage(unit, r.param, r.param_offset + done, elem, change)
                if on_host:
                    _reseed(old, new, elem, change)
        if not on_host:
            base.copy_(out[: group.nbytes])
        return dense

    def _chunk_bytes(self, elem: int) -> int:
        """Bytes compared as one record: its sparse form, always smaller than its dense
        bytes, then fits an empty patch buffer."""
        assert self._pool is not None
        return max(elem, min(self._pool.nbytes, MAX_RECORD_ELEMENTS * elem) // elem * elem)

    def _stage(self, unit: str, param: str, param_offset: int, elem: int, change: Change) -> None:
        assert self._pool is not None and change.meta is not None and change.values is not None
        kind: Kind = change.kind  # type: ignore[assignment]  # sparse: diff gave it pieces
        size = record_bytes(kind, change.count, change.changed, elem)
        if self._open is not None and (self._open.unit != unit or self._open.nbytes + size > self._pool.nbytes):
            self.flush()
        if self._open is None:
            self._open = StagedPatch(unit, self._pool.acquire(self.acquire_timeout, self.on_stall))
        patch = self._open
        buffer = patch.lease.tensor
        meta_at, values_at = patch.nbytes, patch.nbytes + piece(change.meta.numel())
        buffer[meta_at : meta_at + change.meta.numel()].copy_(change.meta)
        buffer[values_at : values_at + change.values.numel()].copy_(change.values)
        patch.records.append(
            PatchRecord(param, param_offset, elem, change.count, change.changed, kind, meta_at, values_at)
        )
        patch.nbytes += size

    def flush(self) -> None:
        """Close the patch being staged; it joins those `ready` hands out."""
        if self._open is not None:
            self._ready.append(self._open)
            self._open = None

    def ready(self) -> list[StagedPatch]:
        """Staged patches to write, each holding its buffer until the caller releases it."""
        out, self._ready = self._ready, []
        return out

    def targets_of(self, patch: StagedPatch) -> list[TargetTable]:
        """The delta targets of the patch's unit."""
        return [t for t in self._served[patch.unit] if (patch.unit, t.target) in self._delta]

    def placed(self, patch: StagedPatch, table: TargetTable) -> tuple[int, list[PatchRecord]]:
        """Where in `table`'s patch area this rank writes `patch` (its share's address), and
        the records as the engine reads them there."""
        assert table.patch_area is not None, "a delta target has a patch area"
        at = self._share[0] * _share_bytes(table.patch_area[1], self._share)
        if not at:
            return table.patch_area[0], patch.records
        records = [replace(r, meta_offset=r.meta_offset + at, values_offset=r.values_offset + at) for r in patch.records]
        return table.patch_area[0] + at, records

    def unit_failed(self, unit: str) -> None:
        """Producing `unit` failed: drop what was staged for it and mark its baseline broken."""
        for patch in [p for p in [self._open, *self._ready] if p is not None and p.unit == unit]:
            patch.lease.release()
        self._ready = [p for p in self._ready if p.unit != unit]
        if self._open is not None and self._open.unit == unit:
            self._open = None
        self.store.break_unit(unit)

    def finish(self, report: UpdateReport) -> None:
        """After the update's report (the same on every rank; collective): record which
        targets hold this update, seal the baselines, and add what delta mode did to the report."""
        per_rank = collectives.all_gather((self.store.held_bytes + self.buffer_bytes, self.stats))
        report.delta_memory_bytes = sum(held for held, _ in per_rank)
        for _, stats in per_rank:
            for target in stats.targets:
                report.engines[target.engine_id].delta_ranks.append(target.rank)
            report.changed_elements += stats.changed
            report.compared_elements += stats.compared
        for engine in report.engines.values():
            engine.delta_ranks = sorted(set(engine.delta_ranks))  # gather-free, several senders patch a rank
        for target, why in sorted(self.stats.altered.items(), key=lambda item: str(item[0])):  # alike on every rank
            report.degraded.append(
                f"delta: {where(target.engine_id, target.rank)} was sent its full bytes, not a delta: {why}"
            )
        over_budget = sum(stats.over_budget for _, stats in per_rank)
        if over_budget:
            report.degraded.append(
                f"delta: {over_budget} unit(s) of the senders do not fit the baselines' memory budget "
                f"({self.options.memory_bytes:,} bytes per rank) and were sent in full"
            )
        for target in self._tables:
            outcome = report.engines.get(target.engine_id)
            if outcome is not None and outcome.ok:
                self._held[target] = (self._updates, self._version)
            else:
                self._held.pop(target, None)
        self.store.seal(self._updates)

    def close(self) -> None:
        """Release what is staged (the connection closes the patch buffers)."""
        for patch in [p for p in [self._open, *self._ready] if p is not None]:
            patch.lease.release()
        self._open, self._ready, self._pool = None, [], None


def _share_bytes(area: int, share: Share) -> int:
    """Bytes of one share of a patch area of `area` bytes (aligned, so records stay aligned)."""
    return area // share[1] // ALIGN * ALIGN


def _reseed(old: torch.Tensor, new: torch.Tensor, elem: int, change: Change) -> None:
    """Make host baseline bytes `old` equal `new`, writing only the changed elements of a sparse change."""
    if change.kind == "dense":
        old.copy_(new)
        return
    assert change.values is not None, "a sparse change has values"
    held = elements(old, elem).numpy()
    held[change.where] = elements(change.values, elem).numpy()
