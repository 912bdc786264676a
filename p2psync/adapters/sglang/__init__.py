"""sglang engines: exact per-rank layouts from sglang's own loaders, and the engine-side endpoint.

Public: `SglangEngineTarget` (the trainer side), `serve` (the engine side of a rank
model), and for tools `serve_rank` (one TP rank built on CPU and served), `rank_params`
(a rank's parameter shapes from sglang's model on meta), `meta_table` (the table a rank
publishes, made on meta without an engine) and `version` (sglang's, if this
adapter supports it; else ImportError or RuntimeError saying why); for RL frameworks
`version_spans` (which p2psync versions produced a server response's tokens).
Nothing here imports sglang until a layout is built or an endpoint served.
"""

from .endpoint import serve
from .shim import require_sglang as version
from .standalone import meta_table, rank_params, serve_rank
from .target import SglangEngineTarget
from .versions import VersionSpan, version_spans

__all__ = [
    "SglangEngineTarget", "VersionSpan", "meta_table", "rank_params", "serve", "serve_rank", "version", "version_spans",
]
