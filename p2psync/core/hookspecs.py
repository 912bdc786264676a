"""Hook specifications of the `p2psync` pluggy project.

Hooks only register classes; behaviour lives in the protocol classes
(`TrainerSource`, `EngineTarget`, `Transport`). A plugin module implements any of
these hooks with `@hookimpl` and is listed under the `p2psync` entry-point group::

    [project.entry-points.p2psync]
    myengine = "my_package.p2psync_plugin"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .engine import EngineTarget
    from .source import TrainerSource
    from .transport import Transport

PROJECT = "p2psync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def p2psync_register_trainer_sources(register: Callable[[type[TrainerSource]], None]) -> None:
    """Register `TrainerSource` subclasses, each under its unique `name`."""


@hookspec
def p2psync_register_engine_targets(register: Callable[[type[EngineTarget]], None]) -> None:
    """Register `EngineTarget` subclasses, each under its unique `name`."""


@hookspec
def p2psync_register_transports(register: Callable[[type[Transport]], None]) -> None:
    """Register `Transport` subclasses, each under its unique `name`."""
