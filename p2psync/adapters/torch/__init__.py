"""A plain torch module as an engine (an HF transformers model, a custom engine, tests)."""

from .endpoint import serve
from .target import IdentityLayout, TorchEngineTarget

__all__ = ["IdentityLayout", "TorchEngineTarget", "serve"]
