"""Layouts: the one room that turns HF tensors into the exact bytes of an engine rank.

An engine adapter supplies a `RankModel` per rank (its model on meta and its own loader),
usually through a `RankModelTarget`; `EngineLayout` compiles it into groups, a copy map
per parameter where the loader only copies, and the loader itself (the replica) where it
does more. Nothing here knows an engine.
"""

from __future__ import annotations

from .rank_model import ParameterHolders, RankModel
from .target import EngineQuantization, LayoutOptions, RankModelTarget

__all__ = ["EngineQuantization", "LayoutOptions", "ParameterHolders", "RankModel", "RankModelTarget"]
