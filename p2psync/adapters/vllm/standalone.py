"""vLLM ranks outside a vLLM worker, for tools and tests (`p2psync bench --engine vllm`):
one TP rank's model served on CPU in this process, with vLLM's own loader of full HF
tensors (which keeps the rank's shard), a rank's parameters read on meta, and the table a
rank publishes, made on meta with no engine running (`p2psync bench --connect`). None runs
vLLM's post-load step: both deliver the loader's bytes, which the vLLM layouts reproduce.
vLLM is imported only when a function is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import shim

if TYPE_CHECKING:
    import torch

    from ...core.rendezvous import Rendezvous
    from ...core.types import TargetTable
    from ...engine.endpoint import EngineEndpoint


def rank_params(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, dtype: str = "bfloat16"
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of TP rank `rank` of an engine of `tp` ranks."""
    model = shim.build_model(shim.engine_config(dict(hf_config), tp=tp, dtype=dtype), rank, "meta")
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def meta_table(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, dtype: str = "bfloat16", engine_id: str = "vllm-0"
) -> TargetTable:
    """The table TP rank `rank` of an engine of `tp` ranks publishes, its model built on meta:
    the layout key `endpoint.serve` makes, no transport, every address 0."""
    from ...engine.endpoint import offline_table
    from .key import layout_key

    config = shim.engine_config(dict(hf_config), tp=tp, dtype=dtype)
    model = shim.build_model(config, rank, "meta")
    params = {name: p.data for name, p in model.named_parameters()}
    return offline_table("vllm", engine_id, rank, tp, params, layout_key(config, model))


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
