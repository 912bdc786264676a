"""The layouts built so far, one per unit (layout key and rank), and the engine targets that
build them: built once and reused by every later connect of any session in this process,
so that a reconnect to engines whose layout keys did not change, or a second session
beside the first (the bench's), compiles nothing.

A layout is kept under everything that decides its bytes: the unit (engine kind and
version, architecture, parallel layout, quantization and rank, as the engine publishes
them), the engine kind's options, the trainer's HF tensors and p2psync's version.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from itertools import zip_longest
from typing import Any

from ..core.engine import EngineTarget
from ..core.errors import ConnectError, P2PSyncError, where
from ..core.layout import Layout
from ..core.plugins import Registry
from ..core.types import ParamSpec, TargetTable
from ..core.version import VERSION
from .plan import unit_of


#: Layouts of this process, least recently used first: key (see `LayoutCache.key`) -> (the
#: unit's parameters, layout); at most `KEPT` of them.
_BUILT: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Layout]] = OrderedDict()
_BUILT_LOCK = threading.Lock()
KEPT = 256


def forget_layouts() -> None:
    """Drop every layout this process keeps (their rank models' memory with them)."""
    with _BUILT_LOCK:
        _BUILT.clear()


class LayoutCache:
    """Engine targets per engine kind (with their `engine_options`) and, process-wide, layouts.
    A refused connect may fill it but never spoils it: entries depend only on what they are
    keyed by."""

    def __init__(self, registry: Registry, engine_options: Mapping[str, Mapping[str, Any]]) -> None:
        self.registry = registry
        self.engine_options = engine_options
        self._targets: dict[str, EngineTarget] = {}

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

    def layouts(self, tables: Iterable[TargetTable], specs: Mapping[str, ParamSpec]) -> dict[str, Layout]:
        """The layout of each unit of `tables`, from the trainer's HF tensors `specs`; every
        later table of a unit must publish the same parameters as the first."""
        sources = tuple(sorted((s.name, tuple(s.shape), s.dtype) for s in specs.values()))  # once per connect
        out: dict[str, Layout] = {}
        for table in tables:
            out.setdefault(unit_of(table.layout_key_text, table.rank), self._layout(table, specs, sources))
        return out

    def _layout(self, table: TargetTable, specs: Mapping[str, ParamSpec], sources: tuple[Any, ...]) -> Layout:
        key = self._key(table, sources)
        params = tuple((p.name, p.shape, p.dtype, p.nbytes) for p in table.params)
        with _BUILT_LOCK:
            cached = _BUILT.get(key)
            if cached is not None:
                _BUILT.move_to_end(key)
        if cached is not None:
            if cached[0] != params:
                differ = next((a or b)[0] for a, b in zip_longest(params, cached[0]) if a != b)
                raise ConnectError(
                    f"{where(table.engine_id, table.rank, differ)} differs from the parameter of another engine "
                    f"rank with the same layout key"
                )
            return cached[1]
        layout = self.target(table).layout(table, specs)
        with _BUILT_LOCK:
            _BUILT[key] = (params, layout)
            while len(_BUILT) > KEPT:
                _BUILT.popitem(last=False)
        return layout

    def _key(self, table: TargetTable, sources: tuple[Any, ...]) -> tuple[Any, ...]:
        """Everything that decides the layout of `table`'s unit (`sources`: the HF tensors)."""
        options = json.dumps(self.engine_options.get(table.engine, {}), sort_keys=True, default=repr)
        target = type(self.target(table))
        return unit_of(table.layout_key_text, table.rank), target, options, sources, VERSION
