"""vLLM ranks outside a vLLM worker, for tools and tests (`p2psync bench --engine vllm`):
one TP rank's model served on CPU in this process, with vLLM's own loader of full HF
tensors (which keeps the rank's shard), and a rank's parameters read on meta. Neither runs
vLLM's post-load step: both deliver the loader's bytes, which the vLLM layouts reproduce.
vLLM is imported only when a function is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import shim

if TYPE_CHECKING:
    import torch

    from ...engine.endpoint import EngineEndpoint
    from ...core.rendezvous import Rendezvous


def rank_params(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, dtype: str = "bfloat16"
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of TP rank `rank` of an engine of `tp` ranks."""
    model = shim.build_model(shim.engine_config(dict(hf_config), tp=tp, dtype=dtype), rank, "meta")
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def serve_rank(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, engine_id: str, rendezvous: Rendezvous, transport: str,
    dtype: str = "bfloat16",
) -> tuple[EngineEndpoint, Callable[[Sequence[tuple[str, torch.Tensor]]], None]]:
    """Build vLLM's model of TP rank `rank` on CPU and serve it (`endpoint.serve`); return the
    endpoint and vLLM's own `load_weights` as that rank."""
    from .endpoint import serve

    config = shim.engine_config(dict(hf_config), tp=tp, dtype=dtype)
    model = shim.build_model(config, rank, "cpu")
    endpoint = serve(model, config, rank=rank, engine_id=engine_id, rendezvous=rendezvous, transport=transport)
    return endpoint, lambda items: shim.load_weights(model, config, rank, items)
