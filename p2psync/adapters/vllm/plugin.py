"""Registers the vLLM engine target with p2psync (vLLM itself is imported only when used)."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_engine_targets(register: Callable[[type], None]) -> None:
    from .target import VllmEngineTarget, VllmLoraTarget

    register(VllmEngineTarget)
    register(VllmLoraTarget)
