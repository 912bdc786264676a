"""Registers the torch.distributed transport."""

from __future__ import annotations

from collections.abc import Callable

from ...core.hookspecs import hookimpl


@hookimpl
def p2psync_register_transports(register: Callable[[type], None]) -> None:
    from .transport import TorchDistTransport

    register(TorchDistTransport)
