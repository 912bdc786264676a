"""Megatron-Core (TP/PP/EP/ETP) and Megatron-Bridge models as trainer sources."""

from .source import MegatronSource

__all__ = ["MegatronSource"]
