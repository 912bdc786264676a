"""sglang ranks outside an sglang server, for tools and tests: one TP rank's model served on
CPU in this process (`p2psync bench --engine sglang` hands the broadcast path's full HF
tensors to sglang's own loader, which keeps the rank's shard, as miles, slime and verl do),
a rank's parameters read from sglang's model on meta (`p2psync plan`'s shapes), and the table a
rank publishes, made on meta with no engine running (`p2psync bench --connect`).
sglang is imported only when a function is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .lora_shim import LoraSettings
from .shim import RankSpec, build_rank_model

if TYPE_CHECKING:
    import torch

    from ...core.rendezvous import Rendezvous
    from ...core.types import TargetTable
    from ...engine.endpoint import EngineEndpoint
    from .lora import LoraRank


def rank_params(
    hf_config: Mapping[str, Any], *, tp: int, ep: int = 1, rank: int, dtype: str = "bfloat16"
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of TP rank `rank` of an engine of `tp` ranks
    with its experts over `ep`."""
    model = build_rank_model(RankSpec(dict(hf_config), tp, ep, dtype, rank), "meta").model
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def meta_table(
    hf_config: Mapping[str, Any], *, tp: int, ep: int = 1, rank: int, dtype: str = "bfloat16",
    engine_id: str = "sglang-0",
) -> TargetTable:
    """The table TP rank `rank` of an engine of `tp` ranks (experts over `ep`) publishes, its
    model built on meta: the layout key `serve` makes, no transport, every address 0."""
    from ...engine.endpoint import offline_table
    from .endpoint import rank_key

    built = build_rank_model(RankSpec(dict(hf_config), tp, ep, dtype, rank), "meta")
    params = {name: p.data for name, p in built.model.named_parameters()}
    return offline_table("sglang", engine_id, rank, tp, params, rank_key(built.server_args, built.model_config))


def serve_rank(
    hf_config: Mapping[str, Any], *, tp: int, rank: int, engine_id: str, rendezvous: Rendezvous, transport: str,
    dtype: str = "bfloat16",
) -> tuple[EngineEndpoint, Callable[[Sequence[tuple[str, torch.Tensor]]], None]]:
    """Build sglang's model of TP rank `rank` on CPU and serve it (`serve`); return the endpoint
    and sglang's own `load_weights` for it."""
    from .endpoint import serve

    rank_model = build_rank_model(RankSpec(dict(hf_config), tp, 1, dtype, rank), "cpu")
    endpoint = serve(
        rank_model.model, rank_model.server_args, rank_model.model_config,
        engine_id=engine_id, rank=rank, rendezvous=rendezvous, transport=transport,
    )
    return endpoint, rank_model.load


def lora_rank(
    hf_config: Mapping[str, Any], settings: LoraSettings, *, tp: int, rank: int, dtype: str = "bfloat16",
) -> LoraRank:
    """Build sglang's model of TP rank `rank` on CPU with its LoRAManager, as a server started
    with `--enable-lora` and `settings` builds them, holding no adapter yet."""
    from .lora import LoraRank
    from .lora_shim import build_lora_manager

    rank_model = build_rank_model(RankSpec(dict(hf_config), tp, 1, dtype, rank), "cpu")
    return LoraRank(rank_model, build_lora_manager(rank_model, settings), rank, settings)
