"""Registers the FSDP2 trainer source."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_trainer_sources(register: Callable[[type], None]) -> None:
    from .source import FSDP2Source

    register(FSDP2Source)
