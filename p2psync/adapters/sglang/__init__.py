"""sglang engines: exact per-rank layouts from sglang's own loaders, and the engine-side endpoint.

Nothing here imports sglang until a layout is built or an endpoint served.
"""

from .endpoint import serve
from .target import SglangEngineTarget

__all__ = ["SglangEngineTarget", "serve"]
