"""The base of engine targets whose layouts come from the engine's own loader on a rank model."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..core.engine import EngineTarget

if TYPE_CHECKING:
    from ..core.layout import Layout
    from ..core.types import ParamSpec, TargetTable
    from .rank_model import RankModel


@dataclass(frozen=True)
class LayoutOptions:
    """`layout`: "copy_map" (strided copies; the engine's loader only for parameters whose bytes
    are not copies of the HF tensors) or "replica" (the engine's loader for every group)."""

    layout: Literal["copy_map", "replica"] = "copy_map"


class RankModelTarget(EngineTarget):
    """An engine kind that says, for a target table, how to build that rank's model
    (`rank_model`); layouts, copy maps and fallbacks come from `p2psync.layouts`.
    Options: `LayoutOptions` (subclasses may extend them)."""

    Options = LayoutOptions

    @abstractmethod
    def rank_model(self, table: TargetTable) -> RankModel:
        """The model of `table`'s rank, on meta, rebuilt from its layout key alone. Raises
        ConnectError naming engine, rank and setting for what no layout can reproduce."""

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        from .layout import EngineLayout

        return EngineLayout(table, sources, self.rank_model(table), mode=self.options.layout)
