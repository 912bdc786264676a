"""An sglang engine rank for `p2psync bench --engine sglang`.

sglang's own model of TP rank `rank` built on CPU, its live parameters served to
p2psync; the broadcast path hands the same rank full HF tensors, which sglang's
own `load_weights` slices into the rank's shard, as miles, slime and verl do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...core.endpoint import EngineEndpoint
    from ...core.rendezvous import Rendezvous


def start_rank(
    hf_config: Mapping[str, Any], tp: int, rank: int, *, engine_id: str, rendezvous: Rendezvous, transport: str,
    dtype: str = "bfloat16",
) -> tuple[EngineEndpoint, Callable[[Sequence[tuple[str, torch.Tensor]]], None]]:
    """Build and serve the rank; return its endpoint and sglang's loader of full HF tensors."""
    from .endpoint import serve
    from .shim import RankSpec, build_rank_model

    rank_model = build_rank_model(RankSpec(dict(hf_config), tp, 1, dtype, rank), "cpu")
    endpoint = serve(
        rank_model.model, rank_model.server_args, rank_model.model_config,
        engine_id=engine_id, rank=rank, rendezvous=rendezvous, transport=transport,
    )
    return endpoint, rank_model.load
