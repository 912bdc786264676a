"""Per-rank shapes from the real engine code: sglang's own model of each rank, on meta.

Through the sglang adapter's public `rank_params` (sglang's model of a rank built on
the meta device: no storage). To stay fast, the model is built with only as many layers as it takes to hold one
of each layer kind, and the per-kind parameters are read from it; the planner
multiplies them by the number of layers of each kind (layers of one kind hold
equal shapes).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from .shapes import Param, RankShapes, ShapeModel, analytic_shapes, layer_kinds

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def sglang_available() -> tuple[bool, str]:
    """Whether sglang's meta-device rank model can be used here, and why not."""
    try:
        from ..adapters.sglang import version

        return True, version()
    except Exception as exc:  # not installed, wrong version, broken install
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0][:160]


def _reduced(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[int, str]]:
    """A config with the fewest layers that still holds one layer of each kind; layer index -> kind."""
    kinds = layer_kinds(cfg)
    keep: dict[str, int] = {}
    for i, k in enumerate(kinds):
        keep.setdefault(k, i)
    n = max(keep.values()) + 1
    small = copy.deepcopy(cfg)
    small["num_hidden_layers"] = n
    small.pop("num_nextn_predict_layers", None)
    if isinstance(small.get("layer_types"), list):  # per-layer lists must match the layer count
        small["layer_types"] = small["layer_types"][:n]
    return small, {i: kinds[i] for i in keep.values()}


#: The checkpoint config of an fp8 engine the planner models: block-quantized, [128, 128] scales.
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def sglang_shapes(cfg: dict[str, Any], tp: int, ep: int, dtype: str) -> ShapeModel:
    """Shapes of every rank of an sglang engine (tp ranks, experts over ep), from sglang's model on
    meta; for fp8, of the fp8 checkpoint (`FP8_CONFIG`, or the config's own `quantization_config`)."""
    from ..adapters.sglang import rank_params, version

    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"sglang meta shapes: bf16 or fp8 engines, not {dtype!r}")
    sglang_version = version()
    small, picked = _reduced(cfg)
    if dtype == "fp8":
        small.setdefault("quantization_config", FP8_CONFIG)
    ranks: list[RankShapes] = []
    for rank in range(tp):
        parts: dict[str, list[Param]] = {"embed": [], "final": []}
        for name, shape, param_dtype in rank_params(small, tp=tp, ep=ep, rank=rank, dtype="bfloat16"):
            param = Param(name, shape, param_dtype)
            m = _LAYER.match(name)
            if m:
                i = int(m.group(1))
                if i in picked:
                    layer_param = Param(f"model.layers.*.{m.group(2)}", param.shape, param.dtype)
                    parts.setdefault(picked[i], []).append(layer_param)
            elif "embed_tokens" in name:
                parts["embed"].append(param)
            else:
                parts["final"].append(param)
        ranks.append(RankShapes(parts))
    base = analytic_shapes(cfg, 1, 1, dtype)  # the unsharded model, for the broadcast path and the totals
    return ShapeModel(
        source=f"shapes from sglang {sglang_version} on meta", layer_kinds=layer_kinds(cfg), ranks=ranks, full=base.full,
        numel_total=base.numel_total,
    )


def shapes_for(
    cfg: dict[str, Any], tp: int, ep: int, dtype: str, want: str = "auto", dp_attention: bool = False
) -> ShapeModel:
    """`want`: "sglang" (the real engine code; error if it cannot be used), "analytic", or "auto"
    (sglang when it imports and there is no DP attention, else analytic, saying why)."""
    if want == "analytic":
        return analytic_shapes(cfg, tp, ep, dtype, "requested", dp_attention)
    ok, why = sglang_available()
    if want == "sglang":
        if not ok:
            raise RuntimeError(f"--shapes sglang: sglang cannot be used here ({why}); pip install 'p2psync[sglang]'")
        if dp_attention:
            raise ValueError("--shapes sglang: DP attention is modelled analytically only")
        return sglang_shapes(cfg, tp, ep, dtype)
    if not ok:
        return analytic_shapes(cfg, tp, ep, dtype, "sglang not installed" if "No module" in why else why, dp_attention)
    if dp_attention:
        return analytic_shapes(cfg, tp, ep, dtype, "DP attention is modelled analytically only", dp_attention)
    try:
        return sglang_shapes(cfg, tp, ep, dtype)
    except (ValueError, AssertionError) as exc:  # e.g. an fp8 block the TP split does not divide
        said = str(exc).splitlines()[0] if str(exc) else "an assertion failed"
        return analytic_shapes(cfg, tp, ep, dtype, f"sglang does not build this engine rank: {said}", dp_attention)
