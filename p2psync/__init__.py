"""p2psync: move updated LLM weights from RL trainers into running inference engines, point to point.

The public surface, for users (a trainer's `Session`, its options and reports, the errors)
and for plugin authors (the protocol classes a trainer source, an engine target or a
transport implements, the types they exchange, and the `hookimpl` marker); the conformance
suite they run is `p2psync.conformance`. `import p2psync` stays light: each name is
imported on first use, and frameworks only by their adapters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.version import VERSION as __version__

if TYPE_CHECKING:
    from .core.engine import EngineControl, EngineTarget
    from .core.errors import (
        ConcurrentCallError,
        ConnectError,
        ControlError,
        EngineUnreachable,
        OptionsError,
        P2PSyncError,
        PluginError,
        RendezvousError,
        TrainerLost,
        TrainerRankFailed,
        TransferError,
        TransferTimeout,
        UpdateError,
        VersionError,
        where,
    )
    from .core.hookspecs import hookimpl
    from .core.layout import CopyRun, Layout, ParamGroup
    from .core.pause import PAUSE_MODES, PauseMode
    from .core.plugins import Registry, registry
    from .core.rendezvous import Rendezvous
    from .core.report import ConnectReport, EngineReport, UpdateReport
    from .core.source import LocalShard, TrainerSource
    from .core.transport import Peer, Transport, WriteBatch
    from .core.types import ParamSpec, Region, SenderGroup, TargetId, TargetParam, TargetTable
    from .engine.endpoint import EndpointControl, EndpointOptions, EngineEndpoint, EngineHooks
    from .trainer.options import DeltaOptions, SessionOptions
    from .trainer.session import Session
    from .trainer.stats import SessionStats

#: Where each public name lives (imported on first use).
_EXPORTS = {
    **dict.fromkeys(["Session"], "p2psync.trainer.session"),
    **dict.fromkeys(["SessionOptions", "DeltaOptions"], "p2psync.trainer.options"),
    **dict.fromkeys(["SessionStats"], "p2psync.trainer.stats"),
    **dict.fromkeys(["Rendezvous"], "p2psync.core.rendezvous"),
    **dict.fromkeys(["ConnectReport", "UpdateReport", "EngineReport"], "p2psync.core.report"),
    **dict.fromkeys(
        [
            "P2PSyncError", "PluginError", "OptionsError", "ConnectError", "RendezvousError", "TransferError",
            "TransferTimeout", "ControlError", "EngineUnreachable", "UpdateError", "TrainerLost", "TrainerRankFailed",
            "ConcurrentCallError", "VersionError",
            "where",
        ],
        "p2psync.core.errors",
    ),
    **dict.fromkeys(["EngineTarget", "EngineControl"], "p2psync.core.engine"),
    **dict.fromkeys(["TrainerSource", "LocalShard"], "p2psync.core.source"),
    **dict.fromkeys(["Transport", "Peer", "WriteBatch"], "p2psync.core.transport"),
    **dict.fromkeys(["Layout", "ParamGroup", "CopyRun"], "p2psync.core.layout"),
    **dict.fromkeys(
        ["ParamSpec", "Region", "SenderGroup", "TargetId", "TargetParam", "TargetTable"], "p2psync.core.types"
    ),
    **dict.fromkeys(["PauseMode", "PAUSE_MODES"], "p2psync.core.pause"),
    **dict.fromkeys(["hookimpl"], "p2psync.core.hookspecs"),
    **dict.fromkeys(["Registry", "registry"], "p2psync.core.plugins"),
    **dict.fromkeys(["EngineEndpoint", "EngineHooks", "EndpointOptions", "EndpointControl"], "p2psync.engine.endpoint"),
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'p2psync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
