"""p2psync: move updated LLM weights from RL trainers into running inference engines, point to point.

`import p2psync` stays light: frameworks are imported by their adapters only when used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("p2psync")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from .engine.endpoint import EngineEndpoint, EngineHooks
    from .core.rendezvous import Rendezvous
    from .core.report import UpdateReport
    from .trainer.session import Session

_EXPORTS = {
    "Session": "p2psync.trainer.session",
    "Rendezvous": "p2psync.core.rendezvous",
    "UpdateReport": "p2psync.core.report",
    "EngineEndpoint": "p2psync.engine.endpoint",
    "EngineHooks": "p2psync.engine.endpoint",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'p2psync' has no attribute {name!r}")
