"""One update, on one trainer rank: pause, send, verify, report.

World rank 0 pauses the engines (and renews their leases as buckets go by). Every rank
first writes its own parts of the gather-free groups, then gathers each bucket (a thread
gathering the next while this one is produced: `gather_ahead`) and, for the units the
plan gave it, fills a free transfer buffer through the layout and hands the writes to
each engine's write thread while it fills the other buffer. Once every
write landed: the optional digest check, the report (the same on every rank) and, on
world rank 0, the finish calls of the engines whose writes all landed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.digest import byte_view, digest
from ..core.errors import ControlError, where
from ..core.layout import aligned
from ..core.pause import PauseMode
from ..core.rendezvous import Rendezvous
from ..core.report import EngineReport, PhaseClock, UpdateReport
from ..core.source import TrainerSource
from ..core.transport import WriteBatch
from ..core.types import Region, TargetTable
from . import collectives
from .baseline import Slotted
from .buffers import Lease
from .calls import UpdateCalls
from .compiler import UnitWrites
from .connection import Connection
from .delta_send import Held
from .failures import RankFailures
from .gather_ahead import GatherAhead
from .gatherfree import Packing
from .modes import UpdateMode
from .writer import WriteJob

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Seconds a failed update waits for its engines to hear that it was given up on.
GIVE_UP_WAIT = 5.0

#: Per group of a unit: its bytes, what writes them into a buffer slice (returning the
#: regions), and what its delta baseline is kept by (the group, or a packing's slot).
Fill = tuple[int, Callable[[Any], list[Region]], Slotted]
#: Per engine, what this rank's writes did: bytes per engine rank, seconds to the last, error.
WriteStatus = dict[str, tuple[dict[int, int], float, str | None]]


@dataclass
class Steps:
    """An update's steps (each unit this rank sends gather-free, then each bucket it gathers),
    and the caller's `progress(done, total)`, told after each in bytes this rank produces."""

    progress: Callable[[int, int], None] | None
    sizes: list[int]
    count: int = 0
    produced: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(self.sizes)

    def done(self) -> None:
        self.produced += self.sizes[self.count]
        self.count += 1
        if self.progress is not None:
            self.progress(self.produced, self.total)

    def next(self, what: str) -> str:
        """The step about to run, and `what` it does, in words."""
        return f"step {self.count + 1} of {len(self.sizes)} ({what})"


@dataclass
class Produced:
    """Digest of what a sender produced for one parameter, and where it went."""

    digest: str
    regions: list[Region]


@dataclass(frozen=True)
class RunSettings:
    """What every update of a session shares."""

    rank: int
    check: bool
    timeout: float
    lease: float
    flush_cache: bool


class UpdateRun:
    """The update to `version` over `conn`, in `mode`."""

    def __init__(
        self, conn: Connection, source: TrainerSource, mode: UpdateMode, settings: RunSettings, version: str,
        failures: RankFailures, pause_modes: Mapping[str, PauseMode], rendezvous: Rendezvous,
    ) -> None:
        assert conn.compiled is not None and conn.pool is not None
        self.conn, self.compiled, self.pool = conn, conn.compiled, conn.pool
        self.source, self.mode, self.settings, self.version = source, mode, settings, version
        self.failures, self.rendezvous = failures, rendezvous
        self.clock = PhaseClock()
        self.calls = UpdateCalls(
            conn.controls, version, settings.lease, modes=pause_modes, flush_cache=settings.flush_cache
        )
        self.failed: dict[str, str] = {}  # engines that refused the pause

    def run(self, progress: Callable[[int, int], None] | None, full: bool) -> UpdateReport:
        """The update; every rank takes part in every collective even once its own work failed
        (`failures`), so that each rank raises the same error at the same point."""
        start = time.monotonic()
        failures = self.failures
        leader = self.settings.rank == 0
        paused = failures.run("the pause calls", self._pause) if leader else None
        self.failed, held, moved = collectives.broadcast(paused) or ({}, {}, [])
        failures.run("reopening moved peers", lambda: self.conn.moved(moved))
        self.clock.lap("pause")
        failures.run("the update's start", lambda: self.mode.begin(full, self.version, self.clock, held))
        self.conn.unstick_writers()
        for engine, writer in self.conn.writers.items():
            writer.start_update()
            if engine in self.failed:
                writer.fail(self.failed[engine])

        steps = Steps(progress, self.compiled.step_bytes())
        packed = self._send_gather_free(steps)
        produced = self._send_gathered(steps)
        with failures.guard("waiting for the writes"):
            for writer in self.conn.writers.values():
                writer.wait()
        self.clock.lap("drain")
        if self.settings.check:
            failures.run("the digest check", lambda: self._check([*produced, *packed]))
            self.clock.lap("verify")

        mine: WriteStatus = {
            engine: (w.progress.rank_bytes, (w.progress.last_done or start) - start, w.progress.error)
            for engine, w in self.conn.writers.items()
        }
        per_rank = collectives.all_gather(
            (mine, self.compiled.degraded, self.compiled.gather_free_bytes, failures.error)
        )
        failures.raise_any(self.version, {rank: error for rank, (*_, error) in enumerate(per_rank)})
        made = failures.run("the report", lambda: self._report(start, [p[:3] for p in per_rank])) if leader else None
        report, error = collectives.broadcast((made, failures.error) if leader else None)
        failures.raise_any(self.version, {0: error})
        assert report is not None  # world rank 0 made it, or raise_any raised
        self.clock.lap("finish")
        report.phase_seconds = dict(self.clock.seconds)
        self.mode.finish(report)
        if leader:
            for note in report.degraded:
                log.warning("update %s degraded: %s", self.version, note)
        return report

    def give_up(self, reason: str, wait: float = GIVE_UP_WAIT) -> None:
        """The update failed on the trainer side: world rank 0 tells every engine it paused
        at once (each stays out of serving, naming `reason`), instead of its lease running out;
        it waits up to `wait` seconds for them to hear it (the caller may end its process next)."""
        if self.settings.rank != 0:
            return
        tells = [self.calls.fail(engine, reason) for engine in self.conn.controls if engine not in self.failed]
        deadline = time.monotonic() + wait
        for tell in tells:
            tell.join(max(0.0, deadline - time.monotonic()))

    def _pause(self) -> tuple[dict[str, str], Held, list[TargetTable]]:
        """Pause every engine; in delta mode, ask the paused ones what they hold (a rank that
        holds another version than the baseline's, or changed since, gets its full bytes).
        Also the tables of the ranks whose transport moved."""
        failed, moved = self.calls.pause_all(lambda engine: self.conn.gone(engine, self.rendezvous))
        if not self.mode.proves_baselines:
            return failed, {}, moved
        self.clock.lap("pause")
        ranks = {engine: len(tables) for engine, tables in self.conn.tables.items()}
        held = self.calls.held(ranks, skip=failed)
        self.clock.lap("prove")
        return failed, held, moved

    def _check(self, sent: Sequence[tuple[UnitWrites, dict[str, Produced]]]) -> None:
        self._progressed()
        for writes, produced in sent:
            self._verify(writes, produced)

    def _progressed(self) -> None:
        """Renew the engines' leases (world rank 0); an engine whose writes failed is not
        called again, one that cannot be reached to renew fails at once."""
        if self.settings.rank != 0:
            return
        failed = {*self.failed, *(e for e, w in self.conn.writers.items() if w.progress.error is not None)}
        for engine, error in self.calls.progressed(failed).items():
            self.conn.writers[engine].fail(error)

    def _send_gather_free(self, steps: Steps) -> list[tuple[UnitWrites, dict[str, Produced]]]:
        """Write this rank's own parts of every gather-free group (no collectives: a rank
        stops at its next unit once the update failed anywhere)."""
        out: list[tuple[UnitWrites, dict[str, Produced]]] = []
        if not self.compiled.packed:
            return out
        for writes, packings in self.compiled.packed:
            send = functools.partial(self._send_packed, writes, packings, steps, out)
            self.failures.run(steps.next(f"gather-free parts for {_targets(writes)}"), send)
        self.clock.lap("produce")
        return out

    def _send_packed(
        self, writes: UnitWrites, packings: Sequence[Packing], steps: Steps,
        out: list[tuple[UnitWrites, dict[str, Produced]]],
    ) -> None:
        sent: dict[str, Produced] = {}
        fills: list[Fill] = [(p.nbytes, functools.partial(_fill_packed, p, self.source), p.slot) for p in packings]
        self._send(writes, fills, sent)
        out.append((writes, sent))
        self._progressed()
        steps.done()

    def _send_gathered(self, steps: Steps) -> list[tuple[UnitWrites, dict[str, Produced]]]:
        """Gather each bucket and write the groups the plan gave this rank."""
        produced: dict[str, dict[str, Produced]] = defaultdict(dict)  # unit -> parameter -> what was sent
        units: dict[str, UnitWrites] = {}
        buckets = self.compiled.buckets
        dtypes = self.compiled.gather_dtypes
        ahead = GatherAhead(lambda names: self.source.gather_cast(names, {n: dtypes[n] for n in names if n in dtypes}),
                            buckets)
        try:
            for i, tensors in ahead:  # every bucket is gathered, even after a failure: the others gather too
                self.clock.lap("gather")  # waiting for this bucket's gathers, once production is ahead of them
                send = functools.partial(self._send_bucket, i, tensors, units, produced, steps)
                self.failures.run(steps.next(f"bucket {i + 1} of {len(buckets)}"), send)
                del tensors
        finally:
            ahead.close()
        return [(writes, produced[unit]) for unit, writes in units.items()]

    def _send_bucket(
        self, i: int, tensors: Mapping[str, torch.Tensor], units: dict[str, UnitWrites],
        produced: dict[str, dict[str, Produced]], steps: Steps,
    ) -> None:
        for writes, groups in self.compiled.work[i]:
            units.setdefault(writes.unit, writes)
            fills: list[Fill] = [(g.nbytes, functools.partial(writes.layout.fill, g, tensors), g) for g in groups]
            self._send(writes, fills, produced[writes.unit])
            del fills  # the bucket's tensors go once the next is asked for
        self.clock.lap("produce")
        self._progressed()
        steps.done()

    def _send(self, writes: UnitWrites, fills: list[Fill], produced: dict[str, Produced]) -> None:
        """Fill transfer buffers with one unit's groups and hand them to the writers; in delta
        mode, the unit's delta targets get the mode's dense regions and its patches."""
        lease: Lease | None = None
        regions: list[Region] = []
        dense: list[Region] = []
        offset = 0
        try:
            for nbytes, fill, group in fills:
                if lease is None or offset + nbytes > self.pool.nbytes:
                    if lease is not None:
                        self._submit(writes, lease, regions, dense)
                        lease = None  # _submit released the filler's reference
                    self.clock.lap("produce")
                    lease, regions, dense, offset = self.pool.acquire(self.settings.timeout, self._on_stall), [], [], 0
                    self.clock.lap("buffer_wait")
                out = lease.tensor[offset : offset + nbytes]
                written = [Region(r.param, r.param_offset, r.buffer_offset + offset, r.nbytes) for r in fill(out)]
                regions.extend(written)
                if self.settings.check:
                    _record(lease, written, produced)
                dense.extend(self.mode.produced(writes.unit, group, out, written, offset))
                self._submit_patches()
                offset += aligned(nbytes)
            if lease is not None:
                self._submit(writes, lease, regions, dense)
                lease = None
            self.mode.flush()
            self._submit_patches()
        except Exception as exc:  # a layout or buffer failure fails this unit's engines only
            log.exception("producing bytes for %s failed", _targets(writes))
            for table in writes.targets:
                self.conn.writers[table.engine_id].fail(
                    f"{where(table.engine_id, table.rank)}: {type(exc).__name__}: {exc}"
                )
            if lease is not None:
                lease.release()
            self.mode.unit_failed(writes.unit)

    def _on_stall(self, since: float) -> None:
        self.conn.abandon_laggards(since, self.settings.timeout)

    def _submit(self, writes: UnitWrites, lease: Lease, regions: list[Region], dense: list[Region]) -> None:
        """Hand a filled buffer's writes to the writers: all `regions` to each target, or
        only the `dense` ones to a delta target (its sparse changes go as patches)."""
        for table in writes.targets:
            writer = self.conn.writers[table.engine_id]
            if writer.progress.error is not None:
                continue
            addrs = {p.name: p.addr for p in table.params}
            batch = WriteBatch()
            for r in dense if self.mode.is_delta(writes.unit, table.target) else regions:
                batch.add(lease.addr + r.buffer_offset, addrs[r.param] + r.param_offset, r.nbytes)
            writer.submit(WriteJob(table.target, self.conn.peer(table.target), batch, lease))
        lease.release()

    def _submit_patches(self) -> None:
        """Hand every staged delta patch to the writers of its unit's delta targets: written
        into the target's patch area, then applied there by the engine."""
        for patch in self.mode.ready():
            for table in self.mode.targets_of(patch):
                writer = self.conn.writers[table.engine_id]
                if writer.progress.error is not None or table.patch_area is None:
                    continue
                at, records = self.mode.placed(patch, table)
                batch = WriteBatch()
                batch.add(patch.lease.addr, at, patch.nbytes)
                apply = self.calls.patch(table.engine_id, table.rank, records)
                writer.submit(WriteJob(table.target, self.conn.peer(table.target), batch, patch.lease, after=apply))
            patch.lease.release()

    def _verify(self, writes: UnitWrites, sent: Mapping[str, Produced]) -> None:
        """Ask every target of the unit for digests of what it holds where this rank wrote
        and compare with what was sent; a target that differs fails, naming every parameter
        that differs."""
        if not sent:
            return
        for table in writes.targets:
            writer = self.conn.writers[table.engine_id]
            if writer.progress.error is not None:
                continue
            try:
                held = self.calls.digests(table.engine_id, table.rank, {name: p.regions for name, p in sent.items()})
            except ControlError as exc:
                writer.fail(f"digest check failed: {exc}")
                continue
            wrong = [name for name, p in sent.items() if held.get(name) != p.digest]
            if wrong:
                first = wrong[0]
                more = f"; {len(wrong) - 1} more parameter(s) differ: {', '.join(wrong[1:])}" if wrong[1:] else ""
                writer.fail(
                    f"{where(table.engine_id, table.rank, first)}: digest mismatch after write "
                    f"(sent {sent[first].digest}, engine holds {held.get(first)}){more}"
                )

    def _report(self, start: float, per_rank: Sequence[tuple[WriteStatus, list[str], tuple[int, int]]]) -> UpdateReport:
        """Every rank's write statuses merged per engine, and what degraded; then the finish
        calls (world rank 0)."""
        engines = {
            e: EngineReport(e, ok=e not in self.failed, error=self.failed.get(e), pause=self.calls.modes[e])
            for e in self.conn.tables
        }
        degraded = list(dict.fromkeys(note for _, notes, _ in per_rank for note in notes))
        for statuses, _, _ in per_rank:
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
                if engine not in self.failed:  # paused for this update: out of serving now, told why
                    self.calls.fail(engine, report.error or "")
                continue
            error = self.calls.finish(engine)
            if error is None:
                report.checked = self.settings.check
            else:
                report.ok, report.error = False, error
        return UpdateReport(
            version=self.version, seconds=time.monotonic() - start, engines=engines, degraded=degraded,
            gather_free_bytes=sum(free for _, _, (free, _) in per_rank),
            gathered_bytes=sum(gathered for _, _, (_, gathered) in per_rank),
        )


def _targets(writes: UnitWrites) -> str:
    """The engine ranks a unit's bytes go to, in words (not the unit's layout key)."""
    named = [where(t.engine_id, t.rank) for t in writes.targets]
    return ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")


def _fill_packed(packing: Packing, source: TrainerSource, out: torch.Tensor) -> list[Region]:
    """Fill `packing` from the local shards of its own inputs, read as it fills: a source whose
    shard of a tensor is a copy (Megatron's q, k and v rows of a fused QKV shard) holds one
    group's copies at a time, not the whole model's."""
    packing.fill(source.local_shards(packing.sources), out)
    return packing.regions


def _record(lease: Lease, regions: list[Region], produced: dict[str, Produced]) -> None:
    data = byte_view(lease.tensor)
    by_param: dict[str, list[Region]] = defaultdict(list)
    for r in regions:
        by_param[r.param].append(r)
    for param, rs in by_param.items():
        produced[param] = Produced(digest(data, [(r.buffer_offset, r.nbytes) for r in rs]), rs)
