"""The layouts of a connect, one per unit (layout key and rank), and the engine targets that
build them: taken from this process's memory, else from the layout cache directory, else
compiled, and compiled once for the whole trainer world.

A layout is kept under everything that decides its bytes: the unit (engine kind and
version, architecture, parallel layout, quantization and rank, as the engine publishes
them) and the parameters its table publishes, the engine target class (the package and
version that registered it, and a hash of its package's sources: `adapter_build`) and its
options, the trainer's HF tensors and p2psync's build (`version.layout_build`: its version
is the same at every commit). In memory it is reused by every later connect of any session
in this process (a reconnect to engines whose layout keys did not change, a second session
beside the first) and on disk (`layout_disk`) by later processes, once checked against the
engine's own loader (`p2psync.layouts.verify`) as a fresh compile is: a key cannot tell
every build apart (a plugin without sources), and a well-formed entry can still be wrong.

Sharing the compile: every trainer rank needs every unit's layout (from the HF tensors of
every sender group), so the units no rank holds are split across the world ranks, balanced
by their parameter bytes; each rank compiles its share and an all-gather hands every rank
the others' (`layouts.stored` bytes). A compile that fails on one rank fails the connect on
every rank with that rank's error. Layouts `stored` does not keep (the torch engine's) are
built by every rank. With one rank, nothing is gathered or encoded (but for the disk).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import zip_longest
from pathlib import Path
from typing import Any

from ..core.engine import EngineTarget
from ..core.errors import ConnectError, P2PSyncError, where
from ..core.layout import Layout
from ..core.plugins import Registry
from ..core.types import ParamSpec, TargetTable
from ..core.version import layout_build, source_hash
from ..layouts.target import RankModelTarget
from . import collectives
from .layout_disk import LayoutDisk
from .plan import unit_of

log = logging.getLogger(__name__)

#: Layouts of this process, least recently used first: (engine target class, key text) ->
#: layout; at most `KEPT` of them.
_BUILT: OrderedDict[tuple[type, str], Layout] = OrderedDict()
_BUILT_LOCK = threading.Lock()
KEPT = 256


def forget_layouts() -> None:
    """Drop every layout this process keeps (their rank models' memory with them)."""
    with _BUILT_LOCK:
        _BUILT.clear()


@dataclass(frozen=True)
class LayoutCounts:
    """Where one connect's layouts (one per unit) came from on this rank: `compiled` here,
    `memory` (built before in this process), `disk` (the layout cache directory), `received`
    (compiled by another trainer rank)."""

    compiled: int = 0
    memory: int = 0
    disk: int = 0
    received: int = 0

    def __str__(self) -> str:
        return (
            f"{self.compiled} compiled, {self.memory} from memory, {self.disk} from disk, "
            f"{self.received} from other trainer ranks"
        )


class LayoutCache:
    """Engine targets per engine kind (with their `engine_options`) and their layouts: in this
    process's memory and, with `cache_dir`, on disk. A refused connect may fill it but never
    spoils it: entries depend only on what they are keyed by."""

    def __init__(
        self, registry: Registry, engine_options: Mapping[str, Mapping[str, Any]], cache_dir: str | None = None
    ) -> None:
        self.registry = registry
        self.engine_options = engine_options
        self.disk = LayoutDisk(cache_dir) if cache_dir else None
        self._targets: dict[str, EngineTarget] = {}
        self.counts = LayoutCounts()  # of the last call of `layouts`

    def target(self, table: TargetTable) -> EngineTarget:
        """The engine target of `table`'s engine kind."""
        if table.engine not in self._targets:
            try:
                self._targets[table.engine] = self.registry.engine_target(table.engine)(
                    **self.engine_options.get(table.engine, {})
                )
            except P2PSyncError as exc:
                raise ConnectError(f"{where(table.engine_id, table.rank)}: {exc}") from exc
        return self._targets[table.engine]

    def layouts(
        self, tables: Iterable[TargetTable], specs: Mapping[str, ParamSpec],
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Layout]:
        """The layout of each unit of `tables`, from the trainer's HF tensors `specs` (the same
        on every world rank); every later table of a unit must publish the same parameters as
        the first. Collective over the trainer world where it has more than one rank.
        `progress(done, total)` is told, in layouts, as each unit's is at hand."""
        firsts: dict[str, TargetTable] = {}
        for table in tables:
            first = firsts.setdefault(unit_of(table.layout_key_text, table.rank), table)
            _check_same_params(first, table)
        sources = json.dumps(sorted((s.name, list(s.shape), s.dtype) for s in specs.values()))  # once per connect
        keys = {unit: self._key(table, sources) for unit, table in firsts.items()}
        counts: Counter[str] = Counter()
        out: dict[str, Layout] = {}

        def tell() -> None:
            if progress is not None:
                progress(len(out), len(firsts))

        for unit, table in firsts.items():
            layout = self._remembered(keys[unit])
            counts["memory"] += layout is not None
            if layout is None and self.disk is not None and self._shareable(table):
                layout = self.disk.load(keys[unit][1], partial(self._read, table=table, specs=specs))
                counts["disk"] += layout is not None
                if layout is not None:
                    self._remember(keys[unit], layout)
            if layout is not None:
                out[unit] = layout
                tell()
        if collectives.world_size() > 1:
            self._share(firsts, keys, out, specs, counts)
            tell()
        for unit, table in firsts.items():  # every unit no other rank compiled
            if unit not in out:
                out[unit], _ = self._compile(table, keys[unit], specs)
                counts["compiled"] += 1
                tell()
        self.counts = LayoutCounts(**counts)
        return {unit: out[unit] for unit in firsts}

    # -- sharing the compile between the world's ranks -------------------------------------------

    def _share(
        self, firsts: Mapping[str, TargetTable], keys: Mapping[str, tuple[type, str]], out: dict[str, Layout],
        specs: Mapping[str, ParamSpec], counts: Counter[str],
    ) -> None:
        """Fill `out` with the shareable units this rank lacks: each compiled (or taken from
        memory) by one rank, as `assign` says, and all-gathered."""
        units = [u for u, t in firsts.items() if self._shareable(t)]
        missing = collectives.all_gather([i for i, u in enumerate(units) if u not in out])
        providers = assign(missing, [firsts[u].nbytes for u in units])
        if not providers:
            return
        from ..layouts import stored

        me = collectives.world_rank()
        sent: dict[int, bytes | None] = {}
        error: str | None = None
        try:
            for i in (i for i, rank in providers.items() if rank == me):
                unit = units[i]
                if unit in out:
                    sent[i] = stored.encode(out[unit])
                else:
                    out[unit], sent[i] = self._compile(firsts[unit], keys[unit], specs, encode=True)
                    counts["compiled"] += 1
        except Exception as exc:  # every rank must reach the all_gather: it raises this on every rank
            if not isinstance(exc, P2PSyncError):
                log.exception("compiling a layout failed on this rank")
            error = str(exc) if isinstance(exc, P2PSyncError) else f"{type(exc).__name__}: {exc}"
        gathered = collectives.all_gather((sent, error))
        errors = [f"trainer rank {rank} compiling a layout: {e}" for rank, (_, e) in enumerate(gathered) if e]
        if errors:
            raise ConnectError("; ".join(errors))
        for rank, (payloads, _) in enumerate(gathered):
            for i, payload in payloads.items():
                unit = units[i]
                if unit in out or payload is None:  # None: a layout `stored` does not keep; built below
                    continue
                try:
                    out[unit] = self._decode(payload, firsts[unit])
                except stored.StoredLayoutError as exc:
                    log.warning("%s: the layout trainer rank %d sent does not decode (%s); compiling it", unit, rank, exc)
                    continue
                counts["received"] += 1
                self._remember(keys[unit], out[unit])
                if self.disk is not None and not self.disk.has(keys[unit][1]):
                    self.disk.store(keys[unit][1], payload)

    # -- one unit ------------------------------------------------------------------------------

    def _compile(
        self, table: TargetTable, key: tuple[type, str], specs: Mapping[str, ParamSpec], *, encode: bool = False
    ) -> tuple[Layout, bytes | None]:
        """The layout of `table`'s unit, compiled, kept in memory and on disk; its bytes where
        `encode` says or the disk needs them (None: not kept as bytes)."""
        layout = self.target(table).layout(table, specs)
        self._remember(key, layout)
        payload = None
        if (encode or self.disk is not None) and self._shareable(table):
            from ..layouts import stored

            payload = stored.encode(layout)
            if payload is not None and self.disk is not None:
                self.disk.store(key[1], payload)
        return layout, payload

    def _shareable(self, table: TargetTable) -> bool:
        """Whether `table`'s layout can be kept as bytes: those of engine targets built on rank models."""
        return isinstance(self.target(table), RankModelTarget)

    def _decode(self, data: bytes, table: TargetTable) -> Layout:
        from ..layouts import stored

        target = self.target(table)
        assert isinstance(target, RankModelTarget)
        return stored.decode(data, table, lambda: target.rank_model(table))

    def _read(self, data: bytes, table: TargetTable, specs: Mapping[str, ParamSpec]) -> Layout:
        """The layout of a cache entry's payload, once it is what this build's engine loader makes
        of `specs` (else UnverifiedLayout says why)."""
        from ..layouts.verify import verify

        layout = self._decode(data, table)
        target = self.target(table)
        assert isinstance(target, RankModelTarget)
        verify(layout, table, specs, target)
        return layout

    def _key(self, table: TargetTable, sources: str) -> tuple[type, str]:
        """Everything that decides the layout of `table`'s unit (`sources`: the HF tensors as
        JSON): the engine target class and the text of the rest, one line each."""
        target = type(self.target(table))
        registered = self.registry.entries["engine_targets"].get(table.engine)
        parts: list[Any] = [
            unit_of(table.layout_key_text, table.rank),
            [[p.name, list(p.shape), p.dtype, p.nbytes] for p in table.params],
            [
                f"{target.__module__}.{target.__qualname__}", adapter_build(target),
                *((registered.package, registered.version) if registered else ()),
            ],
            self.engine_options.get(table.engine, {}),
            layout_build(),
        ]
        return target, "\n".join(json.dumps(p, sort_keys=True, default=repr) for p in parts) + "\n" + sources

    @staticmethod
    def _remembered(key: tuple[type, str]) -> Layout | None:
        with _BUILT_LOCK:
            layout = _BUILT.get(key)
            if layout is not None:
                _BUILT.move_to_end(key)
        return layout

    @staticmethod
    def _remember(key: tuple[type, str], layout: Layout) -> None:
        with _BUILT_LOCK:
            _BUILT[key] = layout
            while len(_BUILT) > KEPT:
                _BUILT.popitem(last=False)


def adapter_build(cls: type) -> str:
    """A hash of the sources of engine target `cls`'s package (its module's directory; the module
    alone where it is top-level): what its rank models, hence its layouts, are built from, where
    a version (p2psync's built-ins all register as p2psync's) names many builds."""
    module = sys.modules[cls.__module__]
    file = getattr(module, "__file__", None)
    if file is None:
        return "no sources"
    return source_hash(str(Path(file).parent) if module.__package__ else file)


def assign(missing: Sequence[Sequence[int]], costs: Sequence[int]) -> dict[int, int]:
    """Which world rank provides each unit some rank misses (`missing[rank]`: the indices of the
    units it misses; `costs[i]`: unit i's parameter bytes): a rank that holds it, where one does,
    else the least loaded rank, the costliest units first. The same on every rank."""
    world = len(missing)
    wanted = sorted({i for ranks in missing for i in ranks}, key=lambda i: (-costs[i], i))
    lacking = [set(ranks) for ranks in missing]
    load = [0] * world
    out = {}
    for i in wanted:
        holders = [r for r in range(world) if i not in lacking[r]]
        if holders:
            out[i] = holders[i % len(holders)]
        else:
            out[i] = min(range(world), key=lambda r: (load[r], r))
            load[out[i]] += costs[i]
    return out


def _check_same_params(first: TargetTable, table: TargetTable) -> None:
    mine = [(p.name, p.shape, p.dtype, p.nbytes) for p in table.params]
    theirs = [(p.name, p.shape, p.dtype, p.nbytes) for p in first.params]
    if mine != theirs:
        differ = next((a or b)[0] for a, b in zip_longest(mine, theirs) if a != b)
        raise ConnectError(
            f"{where(table.engine_id, table.rank, differ)} differs from the parameter of another engine "
            f"rank with the same layout key"
        )
