"""What each engine kind's own loader makes of HF tensors on one rank: the bytes a round trip
must find on that rank. None of this calls p2psync's layouts or sources."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .models import ModelSpec

if TYPE_CHECKING:
    import torch

#: What sglang ranks hold before their first load (in tests and worlds): a region the loader
#: leaves alone keeps it, so such a region written by mistake shows.
SGLANG_FILL = 0xA5


def torch_loaded(spec: ModelSpec, dtype: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A torch engine's parameters after `load_state_dict(tensors)` (strict) in `dtype`."""
    import torch

    model = spec.build(seed=0).to(getattr(torch, dtype))
    model.load_state_dict(dict(tensors), strict=True)
    return {name: p.data for name, p in model.named_parameters()}


def sglang_loaded(config: dict[str, Any], tp: int, ep: int, rank: int, tensors: Mapping[str, torch.Tensor]) -> Any:
    """sglang's rank model of `rank` (bfloat16, CPU), parameters prefilled with `SGLANG_FILL`
    bytes, after sglang's own `load_weights` of `tensors`; `config` is the HF config.json."""
    import torch

    from ..adapters.sglang.shim import RankSpec, build_rank_model

    rank_model = build_rank_model(RankSpec(config, tp, ep, "bfloat16", rank), "cpu")
    for p in rank_model.model.parameters():
        p.data.view(-1).view(torch.uint8).fill_(SGLANG_FILL)
    rank_model.load(list(tensors.items()))
    return rank_model


def vllm_loaded(config: Any, rank: int, tensors: Mapping[str, torch.Tensor], fill: int = 0) -> torch.nn.Module:
    """vLLM's model of `rank` on CPU (`config` a VllmConfig), every parameter byte set to `fill`,
    after vLLM's own `load_weights` of `tensors`."""
    import torch

    from ..adapters.vllm import shim

    model = shim.build_model(config, rank, "cpu")
    for p in model.parameters():
        p.data.view(-1).view(torch.uint8).fill_(fill)
    shim.load_weights(model, config, rank, tensors.items())
    return model

