"""vLLM ranks outside a vLLM worker, for tools and tests: one TP rank's model served on CPU
in this process, and the parameters of a rank read from vLLM's model on meta.

`p2psync bench --engine vllm` serves ranks with `serve_rank` and hands the broadcast
path's full HF tensors to the returned loader (vLLM's own `load_weights` as that rank,
which keeps the rank's shard). Neither way runs vLLM's post-load step here: both deliver
the loader's bytes, which is what p2psync's vLLM layouts reproduce. Both functions import
vLLM only when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...core.endpoint import EngineEndpoint
    from ...core.rendezvous import Rendezvous

#: What a served rank does with full HF tensors: vLLM's own `load_weights` of that rank.
Load = Callable[[Sequence[tuple[str, "torch.Tensor"]]], None]


def version() -> str:
    """The installed vLLM's version, if this adapter supports it (raises ImportError or
    RuntimeError saying why not)."""
    from .shim import version as vllm_version

    return vllm_version()


def rank_params(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, dtype: str = "bfloat16"
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of TP rank `rank` of an engine of `tp` ranks,
    from vLLM's own model of that rank built on meta (no storage)."""
    from . import shim

    model = shim.build_model(shim.engine_config(dict(hf_config), tp=tp, dtype=dtype), rank, "meta")
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def serve_rank(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, engine_id: str, rendezvous: Rendezvous, transport: str,
    dtype: str = "bfloat16",
) -> tuple[EngineEndpoint, Load]:
    """Build vLLM's model of TP rank `rank` on CPU and serve it (see `endpoint.serve`);
    return its endpoint and vLLM's own loader of full HF tensors for it."""
    from . import shim
    from .endpoint import serve

    config = shim.engine_config(dict(hf_config), tp=tp, dtype=dtype)
    model = shim.build_model(config, rank, "cpu")
    endpoint = serve(model, config, rank=rank, engine_id=engine_id, rendezvous=rendezvous, transport=transport)

    def load(items: Sequence[tuple[str, torch.Tensor]]) -> None:
        shim.load_weights(model, config, rank, items)

    return endpoint, load
