"""The base of engine targets whose layouts come from the engine's own loader on a rank model."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..core.engine import EngineTarget

if TYPE_CHECKING:
    from ..core.layout import Layout
    from ..core.types import ParamSpec, TargetTable
    from .rank_model import RankModel


@dataclass(frozen=True)
class LayoutOptions:
    """`layout`: "copy_map" (strided copies; the engine's loader only for parameters whose bytes
    are not copies of the HF tensors) or "replica" (the engine's loader for every group).
    `quantizer`: for fp8 engines, the quantizer the sender runs (`p2psync.layouts.quantizers`);
    None: `block-linear` at the engine's block size, or `per-tensor` where it has none."""

    layout: Literal["copy_map", "replica"] = "copy_map"
    quantizer: Literal["block-linear", "block-linear-verl-torch", "block-ue8m0", "per-tensor"] | None = None


@dataclass(frozen=True)
class EngineQuantization:
    """How an engine rank is quantized: its HF `quantization_config` and the dtype its unquantized
    parameters have (what the sender casts to before quantizing)."""

    config: Mapping[str, Any]
    dtype: str


class RankModelTarget(EngineTarget):
    """An engine kind that says, for a target table, how to build that rank's model
    (`rank_model`) and, for fp8 engines, how it is quantized (`quantization`); layouts, copy
    maps, fallbacks and quantization come from `p2psync.layouts`.
    Options: `LayoutOptions` (subclasses may extend them)."""

    Options = LayoutOptions

    @abstractmethod
    def rank_model(self, table: TargetTable) -> RankModel:
        """The model of `table`'s rank, on meta, rebuilt from its layout key alone. Raises
        ConnectError naming engine, rank and setting for what no layout can reproduce."""

    def quantization(self, table: TargetTable) -> EngineQuantization | None:
        """The quantization of `table`'s rank, from its layout key; None (the default) for an
        engine that holds the trainer's tensors unquantized."""
        return None

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        from .layout import EngineLayout

        rank_model = self.rank_model(table)
        quantization = self.quantization(table)
        if quantization is None:
            together = rank_model.produced_together(list(sources))
            return EngineLayout(table, sources, rank_model, mode=self.options.layout, together=together)
        return self._quantized_layout(table, sources, rank_model, quantization)

    def _quantized_layout(
        self, table: TargetTable, sources: Mapping[str, ParamSpec], rank_model: RankModel,
        quantization: EngineQuantization,
    ) -> Layout:
        import torch

        from ..core.errors import ConnectError, where
        from . import quantizers
        from .quantized import QuantizedLayout

        try:
            quantizer = quantizers.for_engine(quantization.config, self.options.quantizer)
        except quantizers.QuantizerError as exc:
            raise ConnectError(f"{where(table.engine_id, table.rank)}: {exc}") from None
        return QuantizedLayout(
            table, sources, rank_model, mode=self.options.layout, quantizer=quantizer,
            dtype=getattr(torch, quantization.dtype),
        )
