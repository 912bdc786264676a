"""The resources of one connection: transfer and patch buffers, transport peers, per-engine
write threads and control clients, beside what `compiler` compiled for them.

`connect` opens a new connection beside the current one, reusing what did not change
(peers of unchanged tables, writers, controls, large enough buffers), and swaps it in
only once every trainer rank succeeded: a refused connect leaves the session exactly as
it was, on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..core.engine import EngineControl
from ..core.errors import RendezvousError
from ..core.pause import PauseMode
from ..core.rendezvous import Rendezvous
from ..core.transport import Peer, Transport
from ..core.types import TargetId, TargetTable
from .buffers import BufferPool
from .compiler import Compiled
from .layouts import LayoutCounts
from .writer import EngineWriter

log = logging.getLogger(__name__)


@dataclass
class Connection:
    """Everything an update of these engines uses."""

    tables: dict[str, list[TargetTable]]
    compiled: Compiled | None = None
    layout_counts: LayoutCounts = field(default_factory=LayoutCounts)  # where its layouts came from
    pool: BufferPool | None = None
    patch_pool: BufferPool | None = None  # delta mode: where patches are staged
    peers: dict[TargetId, tuple[str, Peer]] = field(default_factory=dict)  # target -> (its table's json, peer)
    writers: dict[str, EngineWriter] = field(default_factory=dict)
    controls: dict[str, EngineControl] = field(default_factory=dict)
    pause_modes: dict[str, PauseMode] = field(default_factory=dict)  # the session's mode, per engine
    transport: Transport | None = None  # what the peers were opened with

    def peer(self, target: TargetId) -> Peer:
        return self.peers[target][1]

    def moved(self, tables: Sequence[TargetTable]) -> None:
        """Ranks whose transport moved (they fenced off an unfinished update's writes): write
        to them through new peers from now on, and keep their new tables."""
        for table in tables:
            engine_tables = self.tables.get(table.engine_id, [])
            self.tables[table.engine_id] = [table if t.rank == table.rank else t for t in engine_tables]
            old = self.peers.get(table.target)
            if old is None or self.transport is None:
                continue
            self.peers[table.target] = (table.to_json(), self.transport.open(table))
            old[1].close()
            log.info("engine %s rank %d moved its transport to %s; writing there through a new peer",
                     table.engine_id, table.rank, table.transport_info)

    def gone(self, engine: str, rendezvous: Rendezvous) -> str | None:
        """What became of `engine`, which did not answer, as the rendezvous says, and what to do:
        its table withdrawn (it shut down, or its LoRA slot was unloaded), or published by
        another process (it restarted); None where its table is still the one connected."""
        try:
            tables = rendezvous.read_engine(engine, timeout=0)
        except RendezvousError:
            return "its table was withdrawn (it shut down, or its LoRA slot was unloaded); connect again without it"
        if [t.instance for t in tables] != [t.instance for t in self.tables[engine]]:
            return "it restarted (another process published its table); connect again to update it"
        return None

    def unstick_writers(self) -> None:
        """Before an update: an engine whose writer is still inside a write of an earlier,
        given-up update gets a new writer (see `EngineWriter.successor`)."""
        for engine, writer in self.writers.items():
            if writer.busy:
                log.warning("engine %s: a write of an earlier update has not returned; writing through a new thread",
                            engine)
                self.writers[engine] = writer.successor()

    def open(
        self,
        old: Connection | None,
        transport: Transport,
        control_for: Callable[[Sequence[TargetTable]], EngineControl],
        timeout: float,
    ) -> None:
        """Controls, peers (of the compiled targets) and writers: `old`'s where an engine's
        tables did not change, new ones otherwise."""
        assert self.compiled is not None
        self.transport = transport
        old = old or Connection({})
        for engine, engine_tables in self.tables.items():
            if old.tables.get(engine) == engine_tables and engine in old.controls:
                self.controls[engine] = old.controls[engine]
            else:
                self.controls[engine] = control_for(engine_tables)
            for table in engine_tables:
                if table.target not in self.compiled.targets:
                    continue
                text = table.to_json()
                reused = old.peers.get(table.target)
                if reused is None or reused[0] != text:
                    reused = (text, transport.open(table))
                self.peers[table.target] = reused
                if engine not in self.writers:
                    self.writers[engine] = old.writers.get(engine) or EngineWriter(engine, timeout)

    def abandon_laggards(self, since: float, timeout: float) -> None:
        """Fail the engines whose writes have held a buffer since `since`, so that they
        stop holding back the others."""
        for engine, writer in self.writers.items():
            if writer.holds_since(since):
                log.warning("engine %s held a transfer buffer for %.1f s; failing it", engine, timeout)
                writer.abandon(
                    f"engine {engine!r}: writes did not complete within {timeout:.1f} s and held back the other engines"
                )

    def close_unless_in(self, kept: Connection | None) -> None:
        """Close what this connection holds and `kept` does not share."""
        kept = kept or Connection({})
        _close_others(self.writers.values(), kept.writers.values())
        _close_others((p for _, p in self.peers.values()), (p for _, p in kept.peers.values()))
        _close_others(self.controls.values(), kept.controls.values())
        _close_others([self.pool, self.patch_pool], [kept.pool, kept.patch_pool])


class _Closable(Protocol):
    def close(self) -> None: ...


def _close_others(mine: Iterable[_Closable | None], kept: Iterable[_Closable | None]) -> None:
    shared = {id(k) for k in kept if k is not None}
    for item in mine:
        if item is not None and id(item) not in shared:
            item.close()
