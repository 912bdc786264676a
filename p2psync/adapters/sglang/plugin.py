"""Registers the sglang engine target (importing it does not import sglang)."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_engine_targets(register: Callable[[type], None]) -> None:
    from .target import SglangEngineTarget, SglangLoraTarget

    register(SglangEngineTarget)
    register(SglangLoraTarget)
