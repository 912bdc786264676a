"""The layouts a session has built, one per unit (layout key and rank), and the engine
targets that build them: built once and reused by every later connect, so that a
reconnect to engines whose layout keys did not change compiles nothing."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import zip_longest
from typing import Any

from ..core.engine import EngineTarget
from ..core.errors import ConnectError, P2PSyncError, where
from ..core.layout import Layout
from ..core.plugins import Registry
from ..core.types import ParamSpec, TargetTable
from .plan import unit_of


class LayoutCache:
    """Engine targets per engine kind (with their `engine_options`) and layouts per unit.
    A refused connect may fill it but never spoils it: entries depend only on tables."""

    def __init__(self, registry: Registry, engine_options: Mapping[str, Mapping[str, Any]]) -> None:
        self.registry = registry
        self.engine_options = engine_options
        self._targets: dict[str, EngineTarget] = {}
        self._layouts: dict[str, tuple[tuple[Any, ...], Layout]] = {}  # unit -> (its parameters, layout)

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

    def layout(self, table: TargetTable, specs: Mapping[str, ParamSpec]) -> Layout:
        """The layout of the table's unit; a later table of a unit must publish the same
        parameters as the first."""
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
        layout = self.target(table).layout(table, specs)
        self._layouts[unit] = (params, layout)
        return layout
