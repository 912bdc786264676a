"""vLLM engines as p2psync targets: layouts that reproduce vLLM's own per-rank load
bit for bit, the engine-side endpoint, and a vLLM weight-transfer backend.

Public for tools: `serve_rank` (one TP rank built on CPU and served), `rank_params`
(a rank's parameter shapes from vLLM's model on meta), `meta_table` (the table a rank
publishes, made on meta without an engine) and `version` (vLLM's, if this
adapter supports it; else ImportError or RuntimeError saying why). LoRA: `VllmLoraTarget`, and on
the engine side `VllmAdapterSlots` on a `LoraRank` (`lora_rank` builds one on CPU).
Importing this package does not import vLLM; the modules that need it import it lazily.
"""

from .lora import LoraRank, VllmAdapterSlots, lora_rank, serve_lora
from .lora_shim import LoraSettings
from .shim import version
from .standalone import meta_table, rank_params, serve_rank
from .target import VllmLoraTarget

__all__ = [
    "LoraRank", "LoraSettings", "VllmAdapterSlots", "VllmLoraTarget", "lora_rank", "meta_table", "rank_params",
    "serve_lora", "serve_rank", "version",
]
