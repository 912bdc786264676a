"""Megatron-Core (TP/PP/EP/ETP) and Megatron-Bridge models as trainer sources."""

from .names import ARCHITECTURES
from .source import MegatronSource

__all__ = ["ARCHITECTURES", "MegatronSource"]
