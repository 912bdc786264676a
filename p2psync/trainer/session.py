"""A sync session: `connect` to engines once, then `update` them after each training step.

Every trainer rank runs the same session. All ranks gather every bucket; the
ranks the plan picked as senders turn the HF tensors into each target's bytes
and hand the writes to per-engine write threads. With `gather="auto"`, groups whose
bytes are copies of shards the ranks hold are not gathered: every rank writes its
own part of them to every target (see `gatherfree`). World rank 0 makes the control
calls (pause, and finish for the engines whose writes all landed).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from . import collectives
from .buckets import make_buckets
from .buffers import BufferPool, Lease
from .delta_send import DeltaSender, StagedPatch
from ..core.digest import byte_view, digest
from ..core.engine import EngineControl, EngineTarget
from ..core.errors import ConnectError, ControlError, P2PSyncError, TrainerLost, UpdateError, first_line, where
from .gatherfree import Packing, compile_packing
from ..core.layout import ALIGN, Layout, ParamGroup, aligned
from .lease import UpdateLease
from .liveness import Heartbeat
from .options import SessionOptions
from .plan import Plan, PlanTarget, build_plan, unit_of
from ..core.plugins import Registry, registry as default_registry
from ..core.rendezvous import Rendezvous
from ..core.report import EngineReport, PhaseClock, UpdateReport
from ..core.source import TrainerSource
from ..core.transport import Peer, Transport, WriteBatch
from ..core.types import ParamSpec, Region, TargetId, TargetTable, numel
from .writer import EngineWriter, WriteJob

log = logging.getLogger(__name__)

def _narrower_dtypes(specs: Mapping[str, ParamSpec], reads: Sequence[tuple[Layout, ParamGroup]]) -> dict[str, str]:
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


@dataclass
class _Unit:
    """Targets of one layout key and rank that this sender serves: their bytes are
    produced once and written to each."""

    unit: str
    layout: Layout
    tables: list[TargetTable] = field(default_factory=list)


@dataclass
class _Produced:
    """Digest of what a sender produced for one parameter, and where it went."""

    digest: str
    regions: list[Region]


@dataclass
class _Connection:
    """Everything `connect` sets up for a set of engines. `connect` builds a new one
    beside the current one (reusing its unchanged peers, writers, controls and
    buffers) and swaps it in only once every trainer rank succeeded, so that a refused
    connect leaves the session exactly as it was, on every rank."""

    tables: dict[str, list[TargetTable]]
    plan: Plan | None = None
    buckets: list[list[str]] = field(default_factory=list)
    work: list[list[tuple[_Unit, list[ParamGroup]]]] = field(default_factory=list)
    packed: list[tuple[_Unit, list[Packing]]] = field(default_factory=list)  # gather-free, every unit's targets
    packed_inputs: list[str] = field(default_factory=list)
    gather_dtypes: dict[str, str] = field(default_factory=dict)
    pool: BufferPool | None = None
    patch_pool: BufferPool | None = None  # delta mode: where patches are staged
    peers: dict[TargetId, tuple[str, Peer]] = field(default_factory=dict)  # target -> (table json, peer)
    writers: dict[str, EngineWriter] = field(default_factory=dict)
    controls: dict[str, EngineControl] = field(default_factory=dict)

    def close_unless_in(self, kept: _Connection | None) -> None:
        """Close what this connection holds and `kept` does not share."""
        kept_peers = {id(p) for _, p in kept.peers.values()} if kept else set()
        kept_writers = {id(w) for w in kept.writers.values()} if kept else set()
        kept_controls = {id(c) for c in kept.controls.values()} if kept else set()
        for writer in self.writers.values():
            if id(writer) not in kept_writers:
                writer.close()
        for _, peer in self.peers.values():
            if id(peer) not in kept_peers:
                peer.close()
        for control in self.controls.values():
            if id(control) not in kept_controls:
                control.close()
        if self.pool is not None and (kept is None or kept.pool is not self.pool):
            self.pool.close()
        if self.patch_pool is not None and (kept is None or kept.patch_pool is not self.patch_pool):
            self.patch_pool.close()

    def served_units(self) -> dict[str, tuple[list[TargetTable], list[ParamGroup]]]:
        """Per unit this rank serves: its tables and its groups in sending order."""
        units: dict[str, tuple[list[TargetTable], list[ParamGroup]]] = {}
        for work in self.work:
            for unit, groups in work:
                units.setdefault(unit.unit, (unit.tables, []))[1].extend(groups)
        return units


def _fill_packed(packing: Packing, shards: Mapping[str, Any], out: Any) -> list[Region]:
    packing.fill(shards, out)
    return packing.regions


class Session:
    """Moves a trainer's weights into running engines.

    Construct on every trainer rank with the same arguments. `transport` is a Transport
    instance or a registered name; `options` (`SessionOptions`, or their mapping) say how,
    and keyword `changes` override single options (`Session(..., check=True)`); an
    unknown option is an error naming the valid ones.
    """

    def __init__(
        self,
        *,
        source: TrainerSource,
        transport: Transport | str,
        rendezvous: Rendezvous,
        options: SessionOptions | Mapping[str, Any] | None = None,
        registry: Registry | None = None,
        **changes: Any,
    ) -> None:
        self.options = opts = SessionOptions.of(options, **changes)
        self.registry = registry or default_registry()
        transport = self.registry.make_transport(transport, opts.transport_options)
        transport.bind(rendezvous)
        self.source = source
        self.transport = transport
        self.rendezvous = rendezvous
        self.bucket_bytes = opts.bucket_bytes
        self.transfer_timeout = opts.transfer_timeout
        self.update_lease = opts.lease_seconds
        self.check = opts.check
        self.gather = opts.gather
        self.token = rendezvous.token() if opts.token is None else opts.token
        self.buffer_device = opts.buffer_device
        self.pin_memory = opts.pin_memory
        self.engine_options = opts.engine_options
        self.rank = collectives.world_rank()
        self.group = source.sender_group()
        # Caches that a refused connect may fill but never spoils:
        self._targets: dict[str, EngineTarget] = {}
        self._layouts: dict[str, tuple[tuple[Any, ...], Layout]] = {}  # unit -> (its parameters, layout)
        self._conn: _Connection | None = None
        self._heartbeat = Heartbeat(rendezvous, self.rank, collectives.world_size())
        self._broken: str | None = None  # why update cannot run again
        self._clock = PhaseClock()
        delta_options = opts.delta_options
        self._delta = None if delta_options is None else DeltaSender(
            delta_options, device=opts.buffer_device, pin_memory=opts.pin_memory,
            acquire_timeout=opts.transfer_timeout, on_stall=self._abandon_laggards,
        )

    @property
    def plan(self) -> Plan | None:
        return self._conn.plan if self._conn else None

    @property
    def tables(self) -> dict[str, list[TargetTable]]:
        """The target tables of the connected engines."""
        return self._conn.tables if self._conn else {}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the registered transfer buffers (both of them)."""
        pool = self._conn.pool if self._conn else None
        return pool.nbytes * len(pool.tensors) if pool else 0

    @property
    def delta_bytes(self) -> int:
        """Bytes this rank holds for delta updates: baselines and patch buffers."""
        return self._delta.store.held_bytes + self._delta.buffer_bytes if self._delta else 0

    @property
    def largest_group_bytes(self) -> int:
        """Bytes of the largest parameter group this rank produces."""
        work = self._conn.work if self._conn else []
        return max((g.nbytes for units in work for _, groups in units for g in groups), default=0)

    @property
    def gather_free_bytes(self) -> tuple[int, int]:
        """Bytes of one update that this rank sends gather-free, and of the groups it produces
        from gathered tensors (per target unit; each goes to every target of its unit)."""
        conn = self._conn
        if conn is None:
            return 0, 0
        free = sum(r.nbytes for _, packings in conn.packed for p in packings for r in p.regions)
        gathered = sum(g.nbytes for units in conn.work for _, groups in units for g in groups)
        return free, gathered

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank wrote to engines in the last update."""
        return sum(w.progress.bytes for w in self._writers.values())

    @property
    def write_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of every write this rank made in the last update (monotonic clock)."""
        return sorted(i for w in self._writers.values() for i in w.progress.intervals)

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Where this rank's last update spent its time: pause (until world rank 0 paused the
        engines), gather, produce (filling buffers), delta (comparing with the baselines and
        staging patches, in delta mode), buffer_wait (for a buffer that writes still held),
        drain (the last writes), verify, finish (reports and finish calls)."""
        return dict(self._clock.seconds)

    @property
    def gather_dtypes(self) -> dict[str, str]:
        """HF tensors this rank gathers cast to a narrower dtype (known after `connect`)."""
        return dict(self._conn.gather_dtypes) if self._conn else {}

    @property
    def buckets(self) -> list[list[str]]:
        """The HF tensors of each bucket one update gathers, in order (known after `connect`)."""
        return [list(names) for names in self._conn.buckets] if self._conn else []

    @property
    def bucket_count(self) -> int:
        """How many buckets one update gathers (known after `connect`)."""
        return len(self._conn.buckets) if self._conn else 0

    @property
    def _writers(self) -> dict[str, EngineWriter]:
        return self._conn.writers if self._conn else {}

    # -- connect ---------------------------------------------------------------------------

    def connect(self, engines: Sequence[str]) -> None:
        """Read the engines' target tables, build layouts and the plan, open transport peers.

        Collective over the trainer world. Raises ConnectError on every rank, naming
        engine, rank and parameter, for anything that cannot be served; nothing is
        written then, and the session stays as it was (still connected as before, or
        not at all). Layouts and peers of engines that did not change are reused.
        """
        named_twice = sorted({e for e in engines if list(engines).count(e) > 1})
        if named_twice:
            raise ConnectError(f"engine {named_twice[0]!r} is named twice in connect({list(engines)!r})")
        tables = collectives.broadcast(self._read_tables(engines) if self.rank == 0 else None)
        if isinstance(tables, str):
            raise ConnectError(tables)
        error: str | None = None
        candidate = _Connection(tables)
        held = collectives.all_gather(self._local_ranges())  # before anything that may fail on one rank only
        try:
            specs, mine = self._all_specs()
            self._prepare(candidate, specs, mine, held)
        except Exception as exc:  # every rank must reach the all_gather below, whatever failed
            if not isinstance(exc, P2PSyncError):
                log.exception("connect failed on this rank")
            what = str(exc) if isinstance(exc, P2PSyncError) else f"{type(exc).__name__}: {exc}"
            error = f"rank {self.rank}: {what}"
        errors = [e for e in collectives.all_gather(error) if e]
        if errors:
            candidate.close_unless_in(self._conn)
            raise ConnectError("; ".join(errors))
        if self._conn is not None:
            self._conn.close_unless_in(candidate)
        self._conn = candidate
        if self._delta is not None:
            self._delta.connect(tables, candidate.served_units(), candidate.patch_pool)
        log.info(
            "connected to %d engines (%d targets); serving %d of them from %d buckets",
            len(tables), sum(len(t) for t in tables.values()),
            len(candidate.plan.targets_of(self.rank)) if candidate.plan else 0, len(candidate.buckets),
        )

    def _read_tables(self, engines: Sequence[str]) -> dict[str, list[TargetTable]] | str:
        try:
            return {engine: self.rendezvous.read_engine(engine) for engine in engines}
        except P2PSyncError as exc:
            return str(exc)

    def _all_specs(self) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        """The HF tensors of every sender group, and of this rank's group."""
        mine = {s.name: s for s in self.source.param_specs()}
        union: dict[str, tuple[int, ParamSpec]] = {}
        for rank, rank_specs in enumerate(collectives.all_gather(list(mine.values()))):
            for spec in rank_specs:
                first, seen = union.setdefault(spec.name, (rank, spec))
                if seen != spec:
                    raise ConnectError(
                        f"trainer ranks {first} and {rank} disagree on HF tensor {spec.name!r}: {seen} and {spec}"
                    )
        return {name: spec for name, (_, spec) in union.items()}, mine

    def _local_ranges(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """The flat element ranges of each HF tensor this rank holds for gather-free sends
        (none with `gather="always"`, or where the source cannot say)."""
        if self.gather != "auto":
            return {}
        try:
            shards = self.source.local_shards([s.name for s in self.source.param_specs()])
        except Exception:  # noqa: BLE001 - the tensors are then gathered; every rank must reach the all_gather
            log.exception("the trainer source could not describe its local shards; gathering instead")
            return {}
        return {name: shard.ranges for name, shard in shards.items()}

    def _prepare(
        self,
        conn: _Connection,
        specs: dict[str, ParamSpec],
        mine: dict[str, ParamSpec],
        held: Sequence[Mapping[str, tuple[tuple[int, int], ...]]],
    ) -> None:
        """Fill `conn` for its tables, reusing what the current connection has. `held`: every
        world rank's `_local_ranges`."""
        tables = conn.tables
        units: dict[str, _Unit] = {}
        groups_of: dict[str, list[ParamGroup]] = {}
        for engine_tables in tables.values():
            for table in engine_tables:
                self._check_table(table)
                unit = unit_of(table.layout_key_text, table.rank)
                layout = self._layout(table, specs)  # also for later tables of a unit: their parameters must match
                if unit not in units:
                    units[unit] = _Unit(unit, layout, [table])  # its first table: the parameters
                    groups_of[unit] = self._own_groups(table, layout, mine)

        packed = self._gather_free(units, groups_of, held, mine)
        groups_of = {u: [g for g in gs if g not in packed.get(u, {})] for u, gs in groups_of.items()}
        plan_targets = [
            PlanTarget(table.target, unit, sum(g.nbytes for g in groups_of[unit]))
            for unit, table in (
                (unit_of(t.layout_key_text, t.rank), t) for engine_tables in tables.values() for t in engine_tables
            )
            if groups_of[unit]
        ]
        conn.plan = build_plan(self.group.ranks, plan_targets)
        planned = set(conn.plan.targets_of(self.rank))
        mine_targets = set(planned)  # and every target of a unit this rank sends gather-free parts of
        for unit, packings in packed.items():
            nonempty = [p for p in packings.values() if p.nbytes]
            if nonempty:
                every = [t for ts in tables.values() for t in ts if unit_of(t.layout_key_text, t.rank) == unit]
                conn.packed.append((_Unit(unit, units[unit].layout, every), nonempty))
                mine_targets.update(t.target for t in every)
        conn.packed_inputs = sorted({n for packings in packed.values() for g in packings for n in g.inputs})
        served: dict[str, _Unit] = {}
        for engine_tables in tables.values():
            for table in engine_tables:
                if table.target in planned:
                    unit = unit_of(table.layout_key_text, table.rank)
                    served.setdefault(unit, _Unit(unit, units[unit].layout)).tables.append(table)

        all_groups = [g for groups in groups_of.values() for g in groups]
        conn.gather_dtypes = _narrower_dtypes(mine, [(units[u].layout, g) for u, gs in groups_of.items() for g in gs])
        conn.buckets = make_buckets(list(mine.values()), all_groups, self.bucket_bytes, self.source.bucket_kind)
        bucket_of = {name: i for i, names in enumerate(conn.buckets) for name in names}
        conn.work = [[] for _ in conn.buckets]
        for unit in served.values():
            per_bucket: dict[int, list[ParamGroup]] = defaultdict(list)
            for group in groups_of[unit.unit]:
                per_bucket[bucket_of[group.inputs[0]]].append(group)
            for i, groups in sorted(per_bucket.items()):
                conn.work[i].append((unit, groups))

        conn.pool = self._pool_for(conn.work, conn.packed)
        if self._delta is not None:
            conn.patch_pool = self._delta.pool_for(
                conn.served_units(), self._conn.patch_pool if self._conn else None, self.transport
            )
        self._open(conn, mine_targets)
        if self.rank == 0:
            for control in conn.controls.values():
                try:
                    control.check_access()
                except ControlError as exc:
                    raise ConnectError(str(exc)) from exc

    def _check_table(self, table: TargetTable) -> None:
        if table.transport != self.transport.name:
            raise ConnectError(
                f"{where(table.engine_id, table.rank)} published for transport {table.transport!r}, "
                f"but this trainer uses {self.transport.name!r}"
            )
        if table.job_id != self.rendezvous.job_id:
            raise ConnectError(
                f"{where(table.engine_id, table.rank)} joined job {table.job_id!r}, not {self.rendezvous.job_id!r}"
            )

    def _layout(self, table: TargetTable, specs: dict[str, ParamSpec]) -> Layout:
        """The layout of the table's layout key and rank, built once and reused."""
        unit = unit_of(table.layout_key_text, table.rank)
        params = tuple((p.name, p.shape, p.dtype, p.nbytes) for p in table.params)
        cached = self._layouts.get(unit)
        if cached is not None:
            if cached[0] != params:
                differ = next((a or b)[0] for a, b in zip_longest(params, cached[0]) if a != b)
                raise ConnectError(
                    f"{where(table.engine_id, table.rank, differ)} differs from the parameter of another engine "
                    f"rank with the same layout key"
                )
            return cached[1]
        if table.engine not in self._targets:
            try:
                self._targets[table.engine] = self.registry.engine_target(table.engine)(
                    **self.engine_options.get(table.engine, {})
                )
            except P2PSyncError as exc:
                raise ConnectError(f"{where(table.engine_id, table.rank)}: {exc}") from exc
        layout = self._targets[table.engine].layout(table, specs)
        self._layouts[unit] = (params, layout)
        return layout

    def _own_groups(self, table: TargetTable, layout: Layout, mine: dict[str, ParamSpec]) -> list[ParamGroup]:
        """The groups of `layout` whose inputs this rank's sender group holds."""
        own = []
        for group in layout.groups():
            held = [name in mine for name in group.inputs]
            if all(held):
                own.append(group)
            elif any(held):
                raise ConnectError(
                    f"{where(table.engine_id, table.rank, group.outputs[0])} needs HF tensors "
                    f"{list(group.inputs)}, which are split across sender groups"
                )
        return own

    def _gather_free(
        self,
        units: Mapping[str, _Unit],
        groups_of: Mapping[str, list[ParamGroup]],
        every_rank: Sequence[Mapping[str, tuple[tuple[int, int], ...]]],
        mine: Mapping[str, ParamSpec],
    ) -> dict[str, dict[ParamGroup, Packing]]:
        """Per unit, the packings of the groups this rank sends without a gather: groups of
        copies (`Layout.copy_runs`) whose inputs the ranks of the sender group hold in parts
        (`every_rank`: each world rank's) that cover each tensor exactly once."""
        ranges = every_rank[self.rank]
        held = self._held_once(ranges, every_rank, mine)
        if not held:
            return {}
        out: dict[str, dict[ParamGroup, Packing]] = {}
        for unit, groups in groups_of.items():
            layout = units[unit].layout
            params = {p.name: p for p in units[unit].tables[0].params}
            for group in groups:
                if not set(group.inputs) <= held or layout.copy_runs(group, {}) is None:
                    continue
                inputs = {n: ranges[n] for n in group.inputs}
                constants = self.rank == self.group.ranks[0]
                out.setdefault(unit, {})[group] = compile_packing(layout, group, inputs, params, constants)
        return out

    def _held_once(
        self,
        ranges: Mapping[str, tuple[tuple[int, int], ...]],
        every_rank: Sequence[Mapping[str, Any]],
        mine: Mapping[str, ParamSpec],
    ) -> set[str]:
        """The HF tensors whose parts, over the ranks of this rank's sender group, cover every
        element exactly once."""
        out = set()
        for name in ranges:
            spans = []
            for rank in self.group.ranks:
                if name not in every_rank[rank]:
                    break
                spans += [tuple(span) for span in every_rank[rank][name]]
            else:
                spans.sort()
                ends = [0] + [end for _, end in spans]
                if all(start == end for (start, _), end in zip(spans, ends)) and ends[-1] == numel(mine[name].shape):
                    out.add(name)
        return out

    def _pool_for(
        self, work: list[list[tuple[_Unit, list[ParamGroup]]]], packed: list[tuple[_Unit, list[Packing]]]
    ) -> BufferPool:
        """The current transfer buffers if they are large enough for `work` and `packed`, else new ones."""
        need = ALIGN
        sizes = [[g.nbytes for g in groups] for units in work for _, groups in units]
        sizes += [[p.nbytes for p in packings] for _, packings in packed if packings]
        for nbytes in sizes:
            largest = max(aligned(n) for n in nbytes)
            need = max(need, min(sum(aligned(n) for n in nbytes), max(self.bucket_bytes, largest)))
        current = self._conn.pool if self._conn else None
        if current is not None and current.nbytes >= need:
            return current
        return BufferPool(need, self.transport, device=self.buffer_device, pin_memory=self.pin_memory)

    def _open(self, conn: _Connection, mine: set[TargetId]) -> None:
        """Controls, peers and writers of `conn`: the current connection's where its engine's
        tables did not change, new ones otherwise."""
        old = self._conn or _Connection({})
        for engine, engine_tables in conn.tables.items():
            if old.tables.get(engine) == engine_tables and engine in old.controls:
                conn.controls[engine] = old.controls[engine]
            else:
                conn.controls[engine] = self._targets[engine_tables[0].engine].control(
                    engine_tables, timeout=self.transfer_timeout, token=self.token
                )
            for table in engine_tables:
                if table.target not in mine:
                    continue
                text = table.to_json()
                reused = old.peers.get(table.target)
                if reused is None or reused[0] != text:
                    reused = (text, self.transport.open(table))
                conn.peers[table.target] = reused
                if engine not in conn.writers:
                    conn.writers[engine] = old.writers.get(engine) or EngineWriter(engine, self.transfer_timeout)

    # -- update ----------------------------------------------------------------------------

    def update(
        self, version: str, *, progress: Callable[[int, int], None] | None = None, full: bool = False
    ) -> UpdateReport:
        """Write the trainer's current weights into every connected engine.

        Collective over the trainer world. Returns the same report on every rank;
        engines whose writes or checks failed are left paused and listed as stale.
        `progress(done, total)` is called after each bucket. A failure on the trainer
        side (a lost trainer rank, a failed gather, an exception from `progress`)
        raises UpdateError (TrainerLost naming the lost ranks); the engines paused for
        this update are not resumed, and the session cannot update again. In delta
        mode, `full` sends every target its full bytes this time.
        """
        if self._broken is not None:
            raise UpdateError(self._broken)
        conn = self._conn
        if conn is None:
            raise P2PSyncError("update before connect")
        with self._heartbeat:
            try:
                return self._update(conn, version, progress, full)
            except Exception as exc:
                error = self._failure(version, exc)
        for writer in conn.writers.values():
            writer.abandon(str(error))
        self._broken = f"this session is unusable after update {version!r} failed; close it and connect a new one"
        raise error

    def _failure(self, version: str, exc: Exception) -> UpdateError:
        """The error that `update` raises for `exc`, naming the trainer ranks that were lost."""
        if isinstance(exc, UpdateError):
            return exc
        lost = self._heartbeat.lost()
        cause = f"{type(exc).__name__}: {first_line(exc)}"
        if lost:
            ranks = ", ".join(map(str, lost))
            error: UpdateError = TrainerLost(
                f"update {version!r} failed: trainer rank{'s' if len(lost) > 1 else ''} {ranks} "
                f"{'were' if len(lost) > 1 else 'was'} lost (heartbeat stopped); this rank saw {cause}"
            )
        else:
            error = UpdateError(f"update {version!r} failed on trainer rank {self.rank}: {cause}")
        log.error("%s", error)
        error.__cause__ = exc
        return error

    def _update(
        self, conn: _Connection, version: str, progress: Callable[[int, int], None] | None, full: bool
    ) -> UpdateReport:
        start = time.monotonic()
        self._clock = PhaseClock()
        if self._delta is not None:
            self._delta.begin(full)
        lease = UpdateLease(conn.controls, version, self.update_lease) if self.rank == 0 else None
        paused = lease.pause_all() if lease else None
        failed: dict[str, str] = collectives.broadcast(paused)
        self._clock.lap("pause")
        for engine, writer in conn.writers.items():
            writer.start_update()
            if engine in failed:
                writer.fail(failed[engine])

        produced: dict[str, dict[str, _Produced]] = defaultdict(dict)  # unit -> parameter -> what this rank sent
        packed: dict[str, dict[str, _Produced]] = defaultdict(dict)  # the same, of the gather-free groups
        if conn.packed:
            shards = self.source.local_shards(conn.packed_inputs)
            for unit, packings in conn.packed:
                fills = [(p.nbytes, functools.partial(_fill_packed, p, shards), None) for p in packings]
                self._send(conn, version, unit, fills, packed[unit.unit])
                if lease:
                    lease.progressed(failed)
            del shards
            self._clock.lap("produce")
        for i, names in enumerate(conn.buckets):
            casts = {n: conn.gather_dtypes[n] for n in names if n in conn.gather_dtypes}
            tensors = self.source.gather_cast(names, casts)
            self._clock.lap("gather")
            for unit, groups in conn.work[i]:
                fills = [(g.nbytes, functools.partial(unit.layout.fill, g, tensors), g) for g in groups]
                self._send(conn, version, unit, fills, produced[unit.unit])
            self._clock.lap("produce")
            del tensors
            if lease:
                lease.progressed(failed)
            if progress is not None:
                progress(i + 1, len(conn.buckets))
        for writer in conn.writers.values():
            writer.wait()
        self._clock.lap("drain")
        if self.check:
            if lease:
                lease.progressed(failed)
            served = {unit.unit: unit for work in conn.work for unit, _ in work}
            self._verify(conn, [(unit, produced[key]) for key, unit in served.items()])
            self._verify(conn, [(unit, packed[unit.unit]) for unit, _ in conn.packed])
            self._clock.lap("verify")

        mine = {
            engine: (w.progress.rank_bytes, (w.progress.last_done or start) - start, w.progress.error)
            for engine, w in conn.writers.items()
        }
        report = collectives.broadcast(self._report(conn, version, start, collectives.all_gather(mine), failed))
        self._clock.lap("finish")
        if self._delta is not None:
            self._delta.finish(report)
        return report

    def _send(
        self,
        conn: _Connection,
        version: str,
        unit: _Unit,
        fills: list[tuple[int, Callable[[Any], list[Region]], ParamGroup | None]],
        produced: dict[str, _Produced],
    ) -> None:
        """Fill transfer buffers with one unit's groups and hand them to the writers. `fills`:
        per group, its bytes, what writes them into a buffer slice (returning the regions) and
        the group where it was gathered (None: a gather-free packing), which delta mode diffs."""
        pool = conn.pool
        assert pool is not None
        lease: Lease | None = None
        regions: list[Region] = []
        dense: list[Region] = []  # delta mode: what the unit's delta targets get written in place
        offset = 0
        try:
            for nbytes, fill, group in fills:
                if lease is None or offset + nbytes > pool.nbytes:
                    if lease is not None:
                        self._submit(conn, unit, lease, regions, dense)
                        lease = None  # _submit released the filler's reference
                    self._clock.lap("produce")
                    lease, regions, dense, offset = (
                        pool.acquire(self.transfer_timeout, self._abandon_laggards), [], [], 0
                    )
                    self._clock.lap("buffer_wait")
                out = lease.tensor[offset : offset + nbytes]
                written = [Region(r.param, r.param_offset, r.buffer_offset + offset, r.nbytes) for r in fill(out)]
                regions.extend(written)
                if self.check:
                    self._record(lease, written, produced)
                if self._delta is not None:
                    self._clock.lap("produce")
                    if group is None:  # gather-free: written whole, also to delta targets
                        dense.extend(written)
                    else:
                        dense.extend(self._delta.diff(unit.unit, group, out, written, offset))
                        self._submit_patches(conn, version)
                    self._clock.lap("delta")
                offset += aligned(nbytes)
            if lease is not None:
                self._submit(conn, unit, lease, regions, dense)
                lease = None
            if self._delta is not None:
                self._delta.flush()
                self._submit_patches(conn, version)
        except Exception as exc:  # a layout or buffer failure fails this unit's engines only
            log.exception("producing bytes for %s failed", unit.unit)
            for table in unit.tables:
                conn.writers[table.engine_id].fail(f"{where(table.engine_id, table.rank)}: {type(exc).__name__}: {exc}")
            if lease is not None:
                lease.release()
            if self._delta is not None:
                self._delta.unit_failed(unit.unit)

    def _abandon_laggards(self, since: float) -> None:
        """Fail the engines whose writes have held a buffer since `since`, so that they
        stop holding back the others."""
        for engine, writer in self._writers.items():
            if writer.holds_since(since):
                log.warning("engine %s held a transfer buffer for %.1f s; failing it", engine, self.transfer_timeout)
                writer.abandon(
                    f"engine {engine!r}: writes did not complete within {self.transfer_timeout:.1f} s "
                    "and held back the other engines"
                )

    def _submit(self, conn: _Connection, unit: _Unit, lease: Lease, regions: list[Region], dense: list[Region]) -> None:
        """Hand a filled buffer's writes to the writers: all `regions` to each target, or
        only the `dense` ones to a delta target (its sparse changes go as patches)."""
        for table in unit.tables:
            writer = conn.writers[table.engine_id]
            if writer.progress.error is not None:
                continue
            addrs = {p.name: p.addr for p in table.params}
            batch = WriteBatch()
            delta = self._delta is not None and self._delta.is_delta(table.target)
            for r in dense if delta else regions:
                batch.add(lease.addr + r.buffer_offset, addrs[r.param] + r.param_offset, r.nbytes)
            writer.submit(WriteJob(table.target, conn.peers[table.target][1], batch, lease))
        lease.release()

    def _submit_patches(self, conn: _Connection, version: str) -> None:
        """Hand every staged delta patch to the writers of its unit's delta targets: written
        into the target's patch area, then applied there by the engine."""
        assert self._delta is not None
        for patch in self._delta.ready():
            for table in self._delta.targets_of(patch):
                writer = conn.writers[table.engine_id]
                if writer.progress.error is not None or table.patch_area is None:
                    continue
                batch = WriteBatch()
                batch.add(patch.lease.addr, table.patch_area[0], patch.nbytes)
                apply = self._patch_call(conn.controls[table.engine_id], table, version, patch)
                writer.submit(WriteJob(table.target, conn.peers[table.target][1], batch, patch.lease, after=apply))
            patch.lease.release()

    @staticmethod
    def _patch_call(control: EngineControl, table: TargetTable, version: str, patch: StagedPatch) -> Callable[[], None]:
        records = patch.records
        return lambda: control.apply_patch(table.rank, version, records)

    @staticmethod
    def _record(lease: Lease, regions: list[Region], produced: dict[str, _Produced]) -> None:
        data = byte_view(lease.tensor)
        by_param: dict[str, list[Region]] = defaultdict(list)
        for r in regions:
            by_param[r.param].append(r)
        for param, rs in by_param.items():
            produced[param] = _Produced(digest(data, [(r.buffer_offset, r.nbytes) for r in rs]), rs)

    def _verify(self, conn: _Connection, sent_to: Sequence[tuple[_Unit, dict[str, _Produced]]]) -> None:
        """Ask every target of each unit for digests of what it holds where this rank wrote
        (`sent_to`: unit, what was sent to its targets) and compare."""
        for unit, sent in sent_to:
            if not sent:
                continue
            for table in unit.tables:
                writer = conn.writers[table.engine_id]
                if writer.progress.error is not None:
                    continue
                try:
                    held = conn.controls[table.engine_id].digests(
                        table.rank, {name: p.regions for name, p in sent.items()}
                    )
                except ControlError as exc:
                    writer.fail(f"digest check failed: {exc}")
                    continue
                for name, p in sent.items():
                    if held.get(name) != p.digest:
                        writer.fail(
                            f"{where(table.engine_id, table.rank, name)}: digest mismatch after write "
                            f"(sent {p.digest}, engine holds {held.get(name)})"
                        )
                        break

    def _report(
        self,
        conn: _Connection,
        version: str,
        start: float,
        per_rank: list[dict[str, tuple[dict[int, int], float, str | None]]],
        failed: dict[str, str],
    ) -> UpdateReport | None:
        if self.rank != 0:
            return None
        engines = {e: EngineReport(e, ok=e not in failed, error=failed.get(e)) for e in conn.tables}
        for statuses in per_rank:
            for engine, (rank_bytes, seconds, error) in statuses.items():
                report = engines[engine]
                for rank, nbytes in rank_bytes.items():
                    report.bytes += nbytes
                    report.rank_bytes[rank] = report.rank_bytes.get(rank, 0) + nbytes
                report.seconds = max(report.seconds, seconds)
                if error and report.error is None:
                    report.ok, report.error = False, error
        for engine, report in engines.items():
            if not report.ok:
                log.warning("engine %s is stale: %s", engine, report.error)
                continue
            try:
                conn.controls[engine].finish(version)
                report.checked = self.check
            except ControlError as exc:
                report.ok, report.error = False, f"finish failed: {exc}"
        return UpdateReport(version=version, seconds=time.monotonic() - start, engines=engines)

    # -- close -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop write threads, close peers and control clients, unregister buffers."""
        if self._delta is not None:
            self._delta.close()
        if self._conn is not None:
            self._conn.close_unless_in(None)
            self._conn = None
        self.transport.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
