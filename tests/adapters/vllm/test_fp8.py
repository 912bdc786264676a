"""fp8 vLLM engines: every rank's bytes, weights and scales, equal vLLM's own `load_weights` of
the quantized checkpoint on that rank, bit for bit (vLLM layouts are TP only); what cannot work
is refused at connect. Runs in tox -e conformance-vllm."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("transformers", reason="transformers is not installed")

import dataclasses  # noqa: E402
from functools import lru_cache  # noqa: E402

import torch  # noqa: E402
from tests.helpers.fp8_checkpoints import (  # noqa: E402
    checkpoint, config_dict, fill_bytes, flat_bytes, fp8_checkpoint, fp8_row, quantizer_of, served_in_fp8, specs,
)
from tests.helpers.sglang_models import produce  # noqa: E402

from p2psync.adapters.vllm import shim  # noqa: E402
from p2psync.adapters.vllm.key import config_hash, layout_key  # noqa: E402
from p2psync.adapters.vllm.target import VllmEngineTarget  # noqa: E402
from p2psync.core.errors import ConnectError  # noqa: E402
from p2psync.core.types import TargetParam, TargetTable  # noqa: E402
from p2psync.layouts import quantizers  # noqa: E402

#: (kind, tp, quantizer, block, parameters the engine's loader produces). At TP 4 Qwen3-MoE's experts
#: hold 64 rows: vLLM refines the [128, 128] scale grid to [64, 64] and loads each checkpoint scale
#: into 2 x 2 places, copies too scattered for a copy map: the loader fills that scale (w2's
#: scale refines along rows only, which a copy map takes).
CASES = [
    ("qwen3", 1, "block-linear", 128, ()),
    ("qwen3", 4, "block-linear", 64, ()),
    ("qwen3", 2, "per-tensor", None, ()),
    ("qwen3_moe", 2, "block-linear", 128, ()),
    ("qwen3_moe", 4, "block-linear", 128, ("model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv",)),
    ("deepseek_v3", 2, "block-linear", 128, ()),
    ("deepseek_v3", 4, "block-linear", 64, ()),
]
IDS = [f"{k}-tp{t}-{q}{'-' + str(b) if b else ''}" for k, t, q, b, _ in CASES]


def vllm_rank(kind: str, quantizer: quantizers.Quantizer, tp: int, rank: int):
    """What vLLM holds on `rank` after its own load of the fp8 checkpoint into parameters of 0xA5
    bytes, and the table that rank publishes (with the key an endpoint makes in the engine)."""
    config = shim.engine_config(config_dict(kind, quantizer), tp=tp, dtype="bfloat16")
    model = shim.build_model(config, rank, "cpu")
    held = {name: p.data for name, p in model.named_parameters()}
    fill_bytes(held, 0xA5)
    shim.load_weights(model, config, rank, fp8_checkpoint("vllm", kind, checkpoint(kind), quantizer.quantize).items())
    table = TargetTable(
        engine_id="engine-0", rank=rank, world_size=tp, engine="vllm", layout_key=layout_key(config, model),
        transport="none", transport_info={}, control_url="",
        params=tuple(
            TargetParam(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), 0, t.numel() * t.element_size())
            for n, t in held.items()
        ),
    )
    return held, table


@pytest.mark.parametrize(
    "kind,tp,name,block,by_loader", [pytest.param(*c, id=i, marks=fp8_row("vllm", c[3])) for c, i in zip(CASES, IDS)]
)
def test_fp8_copy_map_equals_vllm_load_on_every_rank(kind, tp, name, block, by_loader):
    quantizer = quantizer_of(name, block)
    tensors = checkpoint(kind)
    for rank in range(tp):
        expected, table = vllm_rank(kind, quantizer, tp, rank)
        assert table.layout_key["fp8_kernels"]["linear"] == [shim.FP8_STAND_IN]
        layout = VllmEngineTarget().layout(table, specs(tensors))
        assert layout.quantizer == quantizer
        read = {n for group in layout.groups() for n in group.inputs}  # EP: this rank's experts only
        assert layout.quantized == {n for n in read if served_in_fp8("vllm", kind, n)}
        assert layout.loader_params == list(by_loader), "vLLM's fp8 loads copy: weights and scales are copy maps"
        held = produce(layout, tensors, table)
        for param, tensor in expected.items():
            assert torch.equal(held[param], flat_bytes(tensor)), (kind, tp, name, block, rank, param)


def test_fp8_replica_equals_vllm_load_on_every_rank():
    quantizer = quantizer_of("block-linear", 128)
    tensors = checkpoint("qwen3_moe")
    for rank in range(2):
        expected, table = vllm_rank("qwen3_moe", quantizer, 2, rank)
        layout = VllmEngineTarget(layout="replica").layout(table, specs(tensors))
        held = produce(layout, tensors, table)
        for param, tensor in expected.items():
            assert torch.equal(held[param], flat_bytes(tensor)), (rank, param)


# --- refused at connect, before anything is written ---------------------------------------------


@lru_cache(maxsize=None)
def qwen3_table(tp: int = 2, block: int = 128) -> TargetTable:
    return vllm_rank("qwen3", quantizer_of("block-linear", block), tp, 1)[1]


def refused(table: TargetTable, sources=None, **options) -> str:
    with pytest.raises(ConnectError, match="^engine 'engine-0' rank 1: ") as info:
        VllmEngineTarget(**options).layout(table, sources or specs(checkpoint("qwen3")))
    return str(info.value)


def with_key(table: TargetTable, **changes) -> TargetTable:
    return dataclasses.replace(table, layout_key={**table.layout_key, **changes})


def test_engines_whose_fp8_kernels_rewrite_weights_after_loading_are_refused_naming_them():
    kernels = {"linear": ["CutlassFp8BlockScaledMMKernel"], "moe": []}
    text = refused(with_key(qwen3_table(), fp8_kernels=kernels))
    assert (
        f"fp8 kernels {kernels!r}: vLLM's post-load step (process_weights_after_loading) rewrites fp8 weights "
        "and scales into these kernels' format"
    ) in text


def test_a_quantizer_the_engines_block_size_does_not_serve_is_refused():
    assert "engine weight_block_size is [128, 128], ours is None" in refused(qwen3_table(), quantizer="per-tensor")


def test_a_block_size_the_tp_split_does_not_divide_is_refused_with_vllms_reason():
    """Qwen3's MLP at TP 4 holds 128 rows per rank: [64, 64] and [128, 128] load, [256, 256] does not."""
    config = config_dict("qwen3", quantizer_of("block-linear", 256))
    table = with_key(qwen3_table(4, 64), hf_config=config, hf_config_sha256=config_hash(config))
    text = refused(table)
    assert "vLLM cannot build this rank: Weight input_size_per_partition = 128 is not divisible by weight " \
        "quantization block_k = 256" in text


def test_quantization_methods_other_than_fp8_are_refused():
    assert "quantization 'awq' is not supported (fp8 is)" in refused(with_key(qwen3_table(), quantization="awq"))


def test_scale_names_the_engine_does_not_hold_are_refused(monkeypatch):
    table = qwen3_table()
    monkeypatch.setattr(quantizers.Quantizer, "scale_suffix", property(lambda self: "weight_scale_inverse"))
    text = refused(table)
    print(text)
    assert "the engine holds no scale 'model.layers.0." in text
