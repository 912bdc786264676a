"""sglang ranks outside an sglang server, for tools and tests: one TP rank's model served
on CPU in this process, and the parameters of a rank read from sglang's model on meta.

`p2psync bench --engine sglang` serves ranks with `serve_rank` and hands the broadcast
path's full HF tensors to the returned loader (sglang's own `load_weights`, which keeps
the rank's shard, as in miles, slime and verl); `p2psync plan` reads per-rank shapes
with `rank_params`. Both import sglang only when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...core.endpoint import EngineEndpoint
    from ...core.rendezvous import Rendezvous

#: What a served rank does with full HF tensors: sglang's own `load_weights` of that rank.
Load = Callable[[Sequence[tuple[str, "torch.Tensor"]]], None]


def version() -> str:
    """The installed sglang's version, if this adapter supports it (raises ImportError or
    RuntimeError saying why not)."""
    from .shim import require_sglang

    return require_sglang()


def rank_params(
    hf_config: Mapping[str, Any], *, tp: int, ep: int = 1, rank: int, dtype: str = "bfloat16"
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of TP rank `rank` of an engine of `tp` ranks
    (experts over `ep`), from sglang's own model of that rank built on meta (no storage)."""
    from .shim import RankSpec, build_rank_model

    model = build_rank_model(RankSpec(dict(hf_config), tp, ep, dtype, rank), "meta").model
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def serve_rank(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, engine_id: str, rendezvous: Rendezvous, transport: str,
    dtype: str = "bfloat16",
) -> tuple[EngineEndpoint, Load]:
    """Build sglang's model of TP rank `rank` on CPU and serve it (see `serve`); return its
    endpoint and sglang's own loader of full HF tensors for it."""
    from .endpoint import serve
    from .shim import RankSpec, build_rank_model

    rank_model = build_rank_model(RankSpec(dict(hf_config), tp, 1, dtype, rank), "cpu")
    endpoint = serve(
        rank_model.model, rank_model.server_args, rank_model.model_config,
        engine_id=engine_id, rank=rank, rendezvous=rendezvous, transport=transport,
    )
    return endpoint, rank_model.load
