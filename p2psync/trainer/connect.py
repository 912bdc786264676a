"""Building a connection for a session: read the engines' tables, build (or reuse) their
layouts, leave out (naming why) each engine that is not there to serve, compile what this
rank sends, and open the buffers, peers, writers and control clients. Everything here may
fail on one rank only; `Session.connect` runs it between the collectives that make every
rank agree on the outcome. `prepare` holds collectives of its own (the HF tensors of every
rank, the layouts' shared compile, world rank 0's word on who answers): what precedes each
fails on every rank alike or not at all, and the layouts' exchange carries any rank's
compile error to every rank."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..core.engine import EngineControl
from ..core.errors import ConnectError, P2PSyncError, RendezvousError, where
from ..core.host import HOST_ENV, host_of, is_host_local, node_id
from ..core.plugins import Registry
from ..core.rendezvous import Rendezvous
from ..core.report import PhaseClock
from ..core.source import TrainerSource
from ..core.transport import Transport
from ..core.types import ParamSpec, TargetTable
from . import collectives
from .buffers import BufferPool
from .calls import pause_modes, refuse_unchecked, silence
from .compiler import HeldRanges, SenderView, compile_connection
from .connection import Connection
from .layouts import LayoutCache
from .modes import UpdateMode
from .options import SessionOptions

log = logging.getLogger(__name__)


class Connector:
    """What one session's connects share: its trainer, transport and options, and the
    layouts built so far (a reconnect to unchanged layout keys compiles nothing)."""

    def __init__(
        self,
        *,
        source: TrainerSource,
        transport: Transport,
        rendezvous: Rendezvous,
        options: SessionOptions,
        registry: Registry,
        token: str,
        mode: UpdateMode,
    ) -> None:
        self.source, self.transport, self.rendezvous = source, transport, rendezvous
        self.options, self.token, self.mode = options, token, mode
        self.rank = collectives.world_rank()
        self.group = source.sender_group()
        self.layouts = LayoutCache(registry, options.engine_options, options.layout_cache_dir)

    def read_tables(self, engines: Sequence[str]) -> tuple[dict[str, list[TargetTable]], dict[str, str]]:
        """World rank 0: the tables of `engines`, and why each engine whose tables could not be
        read is left out (the rendezvous's timeout is shared by all: several engines gone do
        not add up their waits)."""
        tables: dict[str, list[TargetTable]] = {}
        unread: dict[str, str] = {}
        wait = self.rendezvous.timeout
        for engine in engines:
            started = time.monotonic()
            try:
                tables[engine] = self.rendezvous.read_engine(engine, wait)
            except RendezvousError as exc:
                unread[engine] = (f"its table could not be read from the rendezvous (withdrawn as it shut down or its "
                                  f"LoRA slot was unloaded, or not published yet): {exc}")
            finally:
                wait = max(0.0, wait - (time.monotonic() - started))
        return tables, unread

    def local_ranges(self) -> HeldRanges:
        """The flat element ranges of each HF tensor this rank holds for gather-free sends
        (none with `gather="always"`, or where the source cannot say)."""
        if self.options.gather != "auto":
            return {}
        try:
            shards = self.source.local_shards([s.name for s in self.source.param_specs()])
        except Exception:  # noqa: BLE001 - the tensors are then gathered; every rank must reach the all_gather
            log.exception("the trainer source could not describe its local shards; gathering instead")
            return {}
        return {name: shard.ranges for name, shard in shards.items()}

    def prepare(
        self, conn: Connection, current: Connection | None, held: Sequence[HeldRanges], clock: PhaseClock,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, str]:
        """Check `conn`'s tables and build their layouts (a table the trainer cannot serve fails
        the connect, whether or not its engine answers); then leave out the engines that do not
        answer, the same on every rank (`silent`), and, unless that leaves none or
        `strict_connect` refuses, compile and open the resources of the others, reusing what
        `current` (the session's connection) has. `held`: every world rank's `local_ranges`;
        `progress(done, total)`: the layouts at hand; `clock`: the time of each phase. Returns the
        engines left out, with why."""
        specs, mine = self._all_specs()
        clock.lap("specs")
        tables = [t for engine_tables in conn.tables.values() for t in engine_tables]
        for table in tables:
            self._check_table(table)
        layouts = self.layouts.layouts(tables, specs, progress)  # collective: every rank reaches it or none does
        conn.layout_counts = self.layouts.counts
        log.info("layouts of %d engine ranks: %s", len(layouts), conn.layout_counts)
        clock.lap("layouts")
        silent, refused = collectives.broadcast(self._silent(conn.tables) if self.rank == 0 else None)
        clock.lap("answers")
        if refused is not None:  # every rank leaves out the same engines, or raises alike
            raise ConnectError(refused)
        for engine in silent:
            del conn.tables[engine]
        if not conn.tables or (silent and self.options.strict_connect):
            return silent
        sender = SenderView(
            self.rank, tuple(self.group.ranks), mine, self.options.bucket_bytes, self.source.bucket_kind
        )
        conn.compiled = compiled = compile_connection(conn.tables, layouts, sender, held)
        if self.options.gather == "auto" and not any(held):
            gathers = f"the trainer source {self.source.name!r} describes no local shards; every HF tensor is gathered"
            if len(self.group.ranks) > 1:  # all-gathers where each rank could have sent its own part
                compiled.degraded.append(f"gather-free: {gathers}")
            else:  # one sender holds every tensor whole: its gathers move nothing
                log.info("%s (one sender rank: nothing is all-gathered)", gathers)
        for note in compiled.degraded:
            log.warning("%s", note)
        clock.lap("compile")
        need = compiled.buffer_bytes(self.options.bucket_bytes)
        if current is not None and current.pool is not None and current.pool.nbytes >= need:
            conn.pool = current.pool
        else:
            conn.pool = self._new_pool(need)
        conn.patch_pool = self.mode.pool_for(
            compiled.served, compiled.patch_share, current.patch_pool if current else None, self.transport
        )
        clock.lap("buffers")
        conn.open(current, self.transport, self._control_for, self.options.transfer_timeout)
        conn.pause_modes = pause_modes(conn.controls, self.options.pause_mode)
        if self.options.check:
            refuse_unchecked(conn.controls)
        clock.lap("open")
        return silent

    def _silent(self, tables: dict[str, list[TargetTable]]) -> tuple[dict[str, str], str | None]:
        """World rank 0: why each engine that does not answer at its control address is left
        out, and why the connect fails, if it does (an engine refused the job's credentials)."""
        silent: dict[str, str] = {}
        try:
            for engine, engine_tables in tables.items():
                control = self._control_for(engine_tables)
                try:
                    why = silence(control)
                finally:
                    control.close()
                if why is not None:
                    silent[engine] = why
        except Exception as exc:  # noqa: BLE001 - every rank waits for this word in the broadcast
            return silent, str(exc) if isinstance(exc, P2PSyncError) else f"{type(exc).__name__}: {exc}"
        return silent, None

    def _new_pool(self, nbytes: int) -> BufferPool:
        return BufferPool(nbytes, self.transport, device=self.options.buffer_device, pin_memory=self.options.pin_memory)

    def _control_for(self, tables: Sequence[TargetTable]) -> EngineControl:
        return self.layouts.target(tables[0]).control(tables, timeout=self.options.transfer_timeout, token=self.token)

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
        _check_reachable(table)
        self.source.check_table(table)


def _check_reachable(table: TargetTable) -> None:
    """Refuse a host-local address published from another node: dialed here, it would reach
    this node's loopback, not the engine."""
    if not table.node or table.node == node_id():
        return
    published = [table.control_url, *(v for v in table.transport_info.values() if isinstance(v, str))]
    for address in published:
        if is_host_local(host_of(address)):
            raise ConnectError(
                f"{where(table.engine_id, table.rank)} published the host-local address {address!r} from another node "
                f"(it is on {table.node}, this trainer on {node_id()}): start the engine inside a Ray actor (p2psync "
                f"then publishes the Ray node's address), or set ${HOST_ENV} in the engine's processes to an address "
                "this node reaches"
            )
