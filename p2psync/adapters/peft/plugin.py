"""Registers the LoRA trainer source."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_trainer_sources(register: Callable[[type], None]) -> None:
    from .lora import LoraSource
    from .merge import MergedLoraSource

    register(LoraSource)
    register(MergedLoraSource)
