"""sglang engines: exact per-rank layouts from sglang's own loaders, and the engine-side endpoint.

Public: `SglangEngineTarget` (the trainer side), `serve` (the engine side of a rank
model), for LoRA `SglangLoraTarget`, `serve_lora` and `SglangAdapterSlots` on a `LoraRank` (`lora_rank`
builds one on CPU), and for tools `serve_rank` (one TP rank built on CPU and served), `rank_params`
(a rank's parameter shapes from sglang's model on meta), `meta_table` (the table a rank
publishes, made on meta without an engine) and `version` (sglang's, if this
adapter supports it; else ImportError or RuntimeError saying why); for RL frameworks
`version_spans` (which p2psync versions produced a server response's tokens).
Nothing here imports sglang until a layout is built or an endpoint served.
"""

from .endpoint import serve
from .lora import LoraRank, SglangAdapterSlots, serve_lora
from .lora_shim import LoraSettings
from .shim import require_sglang as version
from .standalone import lora_rank, meta_table, rank_params, serve_rank
from .target import SglangEngineTarget, SglangLoraTarget
from .versions import VersionSpan, version_spans

__all__ = [
    "LoraRank", "LoraSettings", "SglangAdapterSlots", "SglangEngineTarget", "SglangLoraTarget", "VersionSpan",
    "lora_rank", "meta_table", "rank_params", "serve", "serve_lora", "serve_rank", "version", "version_spans",
]
