"""FSDP2 (`fully_shard`, DTensor parameters) as a trainer source."""

from .source import FSDP2Source

__all__ = ["FSDP2Source"]
