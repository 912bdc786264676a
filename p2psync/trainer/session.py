"""A sync session: `connect` to engines once, then `update` them after each training step.

Every trainer rank runs the same session. The session is a facade: `compiler` decides
what each rank sends (plan, buckets, gather-free packings), `connection` holds the
buffers, peers, writers and control clients, `run` carries out one update, and `modes`
decides what each target receives (every byte, or a delta).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Unpack, cast

from ..core.errors import ConnectError, P2PSyncError, TrainerLost, UpdateError, VersionError, first_line
from ..core.exits import CloseAtExit
from ..core.logs import identify
from ..core.pause import PauseMode, pause_mode
from ..core.plugins import Registry, registry as default_registry
from ..core.rendezvous import Rendezvous
from ..core.report import ConnectReport, PhaseClock, UpdateReport, format_phases
from ..core.source import TrainerSource
from ..core.transport import Transport
from ..core.types import TargetTable
from . import collectives
from .calls import label_refusals, pause_modes
from .connect import Connector
from .connection import Connection
from .failures import RankFailures
from .guards import OneCallAtATime, VersionLabels
from .liveness import Heartbeat
from .modes import mode_for
from .options import SessionChanges, SessionOptions
from .plan import Plan
from .run import RunSettings, UpdateRun
from .stats import SessionStats, snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")


class Session:
    """Moves a trainer's weights into running engines.

    Construct on every trainer rank with the same arguments. `transport` is a Transport
    instance or a registered name; `options` (`SessionOptions`, or their mapping) say how,
    and keyword `changes` override single options (`Session(..., check=True)`); an
    unknown option is an error naming the valid ones. `check` may be changed between
    updates (every rank alike).
    """

    def __init__(
        self,
        *,
        source: TrainerSource,
        transport: Transport | str,
        rendezvous: Rendezvous,
        options: SessionOptions | Mapping[str, Any] | None = None,
        registry: Registry | None = None,
        **changes: Unpack[SessionChanges],
    ) -> None:
        self.options = opts = SessionOptions.of(options, **changes)
        self.registry = registry or default_registry()
        self.transport = self.registry.make_transport(transport, opts.transport_options)
        self.transport.bind(rendezvous)
        self.source = source
        self.rendezvous = rendezvous
        self.check = opts.check
        self.token = rendezvous.token() if opts.token is None else opts.token
        self.rank = collectives.world_rank()
        identify(job=rendezvous.job_id, side="trainer", rank=self.rank)
        self._conn: Connection | None = None
        self._heartbeat = Heartbeat(rendezvous, self.rank, collectives.world_size())
        self._broken: str | None = None  # why update cannot run again
        self._last: UpdateRun | None = None
        self._id = uuid.uuid4().hex  # world rank 0's, once connected: this session's keys in the rendezvous
        self._updates = 0  # updates begun: each has its own failure key in the rendezvous
        self._calls = OneCallAtATime(self.rank)
        self._labels = VersionLabels()
        self._mode = mode_for(
            opts.delta_options, device=opts.buffer_device, pin_memory=opts.pin_memory,
            timeout=opts.transfer_timeout, on_stall=self._on_stall,
        )
        self._connector = Connector(
            source=source, transport=self.transport, rendezvous=rendezvous, options=opts,
            registry=self.registry, token=self.token, mode=self._mode,
        )
        self._at_exit = CloseAtExit(self)

    @property
    def plan(self) -> Plan | None:
        compiled = self._conn.compiled if self._conn else None
        return compiled.plan if compiled else None

    @property
    def tables(self) -> dict[str, list[TargetTable]]:
        """The target tables of the connected engines."""
        return self._conn.tables if self._conn else {}

    @property
    def update_lease(self) -> float:
        return self.options.lease_seconds

    @property
    def transfer_timeout(self) -> float:
        return self.options.transfer_timeout

    def stats(self) -> SessionStats:
        """This rank's connection and last update, in one snapshot."""
        return snapshot(self._conn, self._mode, self._last.clock if self._last else None)

    def served_versions(self) -> dict[str, str | None]:
        """The version each connected engine serves now (its first rank's; None: unknown or not
        serving one): where a framework that numbers its updates continues its count, since a
        label an engine served names those weights alone. Asks every engine (no collective)."""
        if self._conn is None:
            raise P2PSyncError("served_versions before connect")
        versions: dict[str, str | None] = {}
        for engine, control in self._conn.controls.items():
            held = control.held()
            versions[engine] = held[min(held)][0] if held else None
        return versions

    def served_count(self, prefix: str = "") -> int:
        """The highest N among the versions the connected engines serve that read `<prefix>N`
        (0 if none): where a framework that labels its updates by a count goes on counting."""
        counts = [v[len(prefix):] for v in self.served_versions().values() if v and v.startswith(prefix)]
        return max([0, *(int(c) for c in counts if c.isdigit())])

    def connect(self, engines: Sequence[str], progress: Callable[[int, int], None] | None = None) -> ConnectReport:
        """Read the engines' target tables, build layouts and the plan, open transport peers.

        Collective over the trainer world. An engine that is not there to serve (its table
        not in the rendezvous within its timeout, no answer at its address: dead, stopped,
        restarting) is left out on every rank alike, named in the report and in a warning,
        and the others connect; it rejoins at a later connect once it answers
        (`strict_connect` fails the connect instead, as does leaving out every engine).
        Raises ConnectError on every rank, naming engine, rank and parameter, for anything
        that cannot be served; nothing is written then, and the session stays as it was
        (still connected as before, or not at all). Layouts and peers of engines that did
        not change are reused. A call while another thread's connect or update runs raises
        ConcurrentCallError. `progress(done, total)` is told, in layouts (one per engine rank
        layout), as each is at hand: compiled, from memory, from disk or from another rank.
        """
        with self._calls.call("connect"):
            return self._connect(engines, progress)

    def _connect(self, engines: Sequence[str], progress: Callable[[int, int], None] | None = None) -> ConnectReport:
        named_twice = sorted({e for e in engines if list(engines).count(e) > 1})
        if named_twice:
            raise ConnectError(f"engine {named_twice[0]!r} is named twice in connect({list(engines)!r})")
        clock = PhaseClock()
        read = (self._connector.read_tables(engines), self._id) if self.rank == 0 else None
        (tables, left_out), self._id = collectives.broadcast(read)
        clock.lap("tables")
        self._refuse_absent(left_out, tables)
        candidate = Connection(tables)
        held = self._on_every_rank(candidate, self._connector.local_ranges)
        clock.lap("shards")
        silent = self._on_every_rank(
            candidate, lambda: self._connector.prepare(candidate, self._conn, held, clock, progress)
        )[0]
        clock.lap("agree")
        left_out.update(silent)
        if silent:
            try:
                self._refuse_absent(left_out, candidate.tables)
            except ConnectError:
                candidate.close_unless_in(self._conn)
                raise
        if self._conn is not None:
            self._conn.close_unless_in(candidate)
        self._conn = candidate
        assert candidate.compiled is not None
        compiled = candidate.compiled
        self._mode.connect(candidate.tables, compiled.served, compiled.patch_share, candidate.patch_pool)
        clock.lap("mode")
        report = ConnectReport(sorted(candidate.tables), left_out, dict(clock.seconds))
        log.info(
            "connected to %d engines (%d targets); serving %d of them from %d buckets; in %s",
            len(candidate.tables), sum(len(t) for t in candidate.tables.values()),
            len(candidate.compiled.plan.targets_of(self.rank)), len(candidate.compiled.buckets),
            format_phases(report.phase_seconds),
        )
        if self.rank == 0:
            for engine, why in left_out.items():
                log.warning("engine %s left out of this connect: %s; a later connect takes it in once it answers",
                            engine, why)
        return report

    def _refuse_absent(self, left_out: Mapping[str, str], remaining: Mapping[str, object]) -> None:
        """ConnectError naming the engines `left_out` where `strict_connect` refuses any, or
        where none `remaining` is there to serve."""
        if left_out and (self.options.strict_connect or not remaining):
            raise ConnectError("; ".join(f"engine {e!r} is not there to serve: {why}" for e, why in left_out.items()))

    def _on_every_rank(self, candidate: Connection, step: Callable[[], T]) -> list[T]:
        """Every rank's `step()`, in rank order; where it raised on any rank, ConnectError on
        every rank naming each failing rank and why (every rank reaches the all_gather, whatever
        failed), and the candidate connection is closed."""
        result: T | None = None
        error: str | None = None
        try:
            result = step()
        except Exception as exc:
            if not isinstance(exc, P2PSyncError):
                log.exception("connect failed on this rank")
            what = str(exc) if isinstance(exc, P2PSyncError) else f"{type(exc).__name__}: {exc}"
            error = f"rank {self.rank}: {what}"
        gathered = collectives.all_gather((result, error))
        errors = [e for _, e in gathered if e]
        if errors:
            candidate.close_unless_in(self._conn)
            raise ConnectError("; ".join(errors))
        return [cast(T, r) for r, _ in gathered]

    def update(
        self,
        version: str,
        *,
        progress: Callable[[int, int], None] | None = None,
        full: bool = False,
        rollback: bool = False,
        pause: PauseMode | Literal["keep"] | None = None,
    ) -> UpdateReport:
        """Write the trainer's current weights into every connected engine.

        Collective over the trainer world. Returns the same report on every rank;
        engines whose writes or checks failed are left paused and listed as stale.
        `progress(done, total)` is told, in bytes this rank produces for its engines, after
        each step: each unit it sends gather-free, then each bucket it gathers. A failure on the trainer
        side raises UpdateError on every rank: TrainerRankFailed naming the rank and its
        exception where a rank's own code raised (`progress`, the source), TrainerLost naming
        the ranks that left the world where a collective failed; the engines paused for
        this update are not resumed, and the session cannot update again. In delta
        mode, `full` sends every target its full bytes this time. A version label used
        before in this session, or one ordering before the latest, raises VersionError
        unless `rollback`, as does one an engine served before, in any session (a rollback must
        bring back the weights the label named there, or that engine does not serve it); a
        call while another thread's runs raises ConcurrentCallError.
        `pause` overrides the session's pause mode for this update (`SessionOptions.pause`); an
        engine that lacks it raises OptionsError before anything is paused or written.
        """
        with self._calls.call("update"):
            return self._update(version, progress, full, rollback, pause)

    def _update(
        self, version: str, progress: Callable[[int, int], None] | None, full: bool, rollback: bool,
        pause: PauseMode | Literal["keep"] | None,
    ) -> UpdateReport:
        if self._broken is not None:
            raise UpdateError(self._broken)
        conn = self._conn
        if conn is None:
            raise P2PSyncError("update before connect")
        modes = conn.pause_modes if pause is None else pause_modes(conn.controls, pause_mode(pause))
        self._labels.check(version, rollback=rollback)
        asked = label_refusals(conn.controls, version, rollback=rollback) if self.rank == 0 else None
        refused = collectives.broadcast(asked)  # every rank raises alike
        if refused:
            raise VersionError(f"version {version!r} refused by the engines: {'; '.join(refused)}")
        self._labels.record(version)
        settings = RunSettings(
            self.rank, self.check, self.options.transfer_timeout, self.options.lease_seconds, self.options.flush_cache
        )
        self._updates += 1
        failures = RankFailures(
            self.rendezvous if collectives.world_size() > 1 else None, self.rank,
            f"trainer/session/{self._id}/update/{self._updates}/failed",
        )
        self._last = UpdateRun(conn, self.source, self._mode, settings, version, failures, modes, self.rendezvous)
        with self._heartbeat:
            try:
                return self._last.run(progress, full)
            except Exception as exc:
                error = self._failure(version, exc)
        for writer in conn.writers.values():
            writer.abandon(str(error))
        self._last.give_up(str(error))
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

    def _on_stall(self, since: float) -> None:
        if self._conn is not None:
            self._conn.abandon_laggards(since, self.options.transfer_timeout)

    def close(self) -> None:
        """Stop write threads, close peers and control clients, unregister buffers (at
        interpreter exit, if not called before)."""
        self._at_exit.cancel()
        self._mode.close()
        if self._conn is not None:
            self._conn.close_unless_in(None)
            self._conn = None
        self.transport.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
