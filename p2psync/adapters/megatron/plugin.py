"""Registers the Megatron-Core, Megatron-Bridge and Bridge-LoRA trainer sources (megatron imported lazily)."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_trainer_sources(register: Callable[[type], None]) -> None:
    from .bridge import BridgeSource
    from .lora import BridgeLoraSource
    from .source import MegatronSource

    register(MegatronSource)
    register(BridgeSource)
    register(BridgeLoraSource)
