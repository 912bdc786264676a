"""fp8 sglang engines: every rank's bytes, weights and scales, equal sglang's own `load_weights`
of the quantized checkpoint on that rank, bit for bit; what cannot work is refused at connect.
Runs in tox -e conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`"
)
pytest.importorskip("transformers", reason="transformers is not installed")

import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import lru_cache  # noqa: E402

import torch  # noqa: E402
from tests.helpers.fp8_checkpoints import (  # noqa: E402
    checkpoint, config_dict, fill_bytes, flat_bytes, fp8_checkpoint, fp8_row, quantizer_of, served_in_fp8, specs,
)
from tests.helpers.sglang_models import produce, table_of  # noqa: E402

from p2psync.adapters.sglang.key import layout_key  # noqa: E402
from p2psync.adapters.sglang.shim import (  # noqa: E402
    RankSpec, build_rank_model, fp8_post_load_settings, hf_config_dict, require_sglang,
)
from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402
from p2psync.core.errors import ConnectError  # noqa: E402
from p2psync.layouts import quantizers  # noqa: E402

#: (kind, tp, ep, quantizer, block): dense, MoE (fused w13/w2, EP 2) and DeepSeek-V3 MLA at TP 1/2/4,
#: blocks [128, 128] and [64, 64] (the TP 4 MoE shards of 64 rows need it) and per-tensor scales.
CASES = [
    ("qwen3", 1, 1, "block-ue8m0", 128),
    ("qwen3", 4, 1, "block-linear", 128),
    ("qwen3", 2, 1, "block-linear", 64),
    ("qwen3", 2, 1, "per-tensor", None),
    ("qwen3_moe", 2, 2, "block-linear", 128),
    ("qwen3_moe", 4, 1, "block-linear", 64),
    ("qwen3_moe", 2, 1, "per-tensor", None),
    ("deepseek_v3", 2, 1, "block-linear", 128),
    ("deepseek_v3", 4, 1, "block-linear", 64),
]
IDS = [f"{k}-tp{t}-ep{e}-{q}{'-' + str(b) if b else ''}" for k, t, e, q, b in CASES]


def reference(quantizer: quantizers.Quantizer) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The oracle's quantizer: sglang's own function where sglang has one (`per_block_cast_to_fp8`
    for block-ue8m0 at [128, 128], `input_to_float8` per tensor), so that those cases share no code
    with p2psync; else p2psync's (block-linear's reference kernels need CUDA; tests/layouts/test_quantizers.py
    checks it op by op)."""
    from sglang.srt.layers.quantization import fp8_utils

    function = {
        ("block-ue8m0", (128, 128)): fp8_utils.per_block_cast_to_fp8, ("per-tensor", None): fp8_utils.input_to_float8,
    }.get((quantizer.name, quantizer.block))
    if function is None:
        return quantizer.quantize

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        weight, scale = function(tensor)
        return {name: weight, quantizer.scale_name(name): scale}

    return quantize


def sglang_rank(kind: str, quantizer: quantizers.Quantizer, tp: int, ep: int, rank: int):
    """What sglang holds on `rank` after its own load of the fp8 checkpoint into parameters of 0xA5
    bytes, and the table that rank publishes (with the key an endpoint makes in the engine)."""
    rank_model = build_rank_model(RankSpec(config_dict(kind, quantizer), tp, ep, "bfloat16", rank), "cpu")
    held = {name: p.data for name, p in rank_model.model.named_parameters()}
    fill_bytes(held, 0xA5)
    rank_model.load(list(fp8_checkpoint("sglang", kind, checkpoint(kind), reference(quantizer)).items()))
    config = rank_model.model_config
    key = layout_key(
        rank_model.server_args, hf_config_dict(config), str(config.dtype), require_sglang(), fp8_post_load_settings()
    )
    return held, table_of(rank_model.model, key, rank)


def check_every_rank(kind: str, tp: int, ep: int, name: str, block: int | None, mode: str) -> None:
    quantizer = quantizer_of(name, block)
    tensors = checkpoint(kind)
    for rank in range(tp):
        expected, table = sglang_rank(kind, quantizer, tp, ep, rank)
        layout = SglangEngineTarget(layout=mode, quantizer=name).layout(table, specs(tensors))
        assert layout.quantizer == quantizer
        read = {n for group in layout.groups() for n in group.inputs}  # EP: this rank's experts only
        assert layout.quantized == {n for n in read if served_in_fp8("sglang", kind, n)}
        if mode == "copy_map":
            assert layout.loader_params == [], "sglang's fp8 loads only copy: weights and scales are copy maps"
        for group in layout.groups():
            if layout.quantized & set(group.inputs):
                assert layout.copy_dtype(group) == "bfloat16", "quantized from the engine dtype, never cast to fp8"
                assert layout.copy_runs(group, {n: [(0, 1)] for n in group.inputs}) is None
        held = produce(layout, tensors, table)
        assert any(t.dtype == torch.float8_e4m3fn for t in expected.values())
        for param, tensor in expected.items():
            assert torch.equal(held[param], flat_bytes(tensor)), (kind, tp, ep, name, block, rank, param)


@pytest.mark.parametrize(
    "kind,tp,ep,name,block", [pytest.param(*c, id=i, marks=fp8_row("sglang", c[4])) for c, i in zip(CASES, IDS)]
)
def test_fp8_copy_map_equals_sglang_load_on_every_rank(kind, tp, ep, name, block):
    check_every_rank(kind, tp, ep, name, block, "copy_map")


def test_fp8_replica_equals_sglang_load_on_every_rank():
    check_every_rank("qwen3_moe", 2, 2, "block-linear", 128, "replica")


def test_post_load_on_fp8_layout_bytes_derives_what_sglangs_load_derives():
    """DeepSeek's MLA derives `w_kc`/`w_vc` (and `w_scale`) from the fp8 `kv_b_proj` and its scale
    after loading; an endpoint runs that step after the writes, and gets sglang's own result."""
    from p2psync.adapters.sglang.shim import post_load

    quantizer = quantizer_of("block-linear", 128)
    tensors = checkpoint("deepseek_v3")
    _, table = sglang_rank("deepseek_v3", quantizer, 2, 1, 1)
    layout = SglangEngineTarget().layout(table, specs(tensors))
    spec = RankSpec(config_dict("deepseek_v3", quantizer), 2, 1, "bfloat16", 1)
    engine = build_rank_model(spec, "cpu")
    for name, data in produce(layout, tensors, table).items():
        flat_bytes(engine.model.get_parameter(name).data).copy_(data)
    post_load(engine.model)
    loaded = build_rank_model(spec, "cpu")
    loaded.load(list(fp8_checkpoint("sglang", "deepseek_v3", tensors, quantizer.quantize).items()))
    for layer, ref in zip(engine.model.model.layers, loaded.model.model.layers):
        for derived in ("w_kc", "w_vc", "w_scale"):
            assert torch.equal(getattr(layer.self_attn, derived), getattr(ref.self_attn, derived)), derived


# --- refused at connect, before anything is written ---------------------------------------------


@lru_cache(maxsize=None)
def qwen3_table(name: str = "block-linear", block: int | None = 128):
    return sglang_rank("qwen3", quantizer_of(name, block), 2, 1, 1)[1]


def refused(table, sources=None, **options) -> str:
    with pytest.raises(ConnectError, match=f"^engine 'engine-0' rank {table.rank}: ") as info:
        SglangEngineTarget(**options).layout(table, sources or specs(checkpoint("qwen3")))
    return str(info.value)


def with_key(table, **changes):
    return dataclasses.replace(table, layout_key={**table.layout_key, **changes})


def test_a_trainer_tensor_already_fp8_is_refused():
    sources = specs(checkpoint("qwen3"))
    name = "model.layers.0.self_attn.q_proj.weight"
    sources[name] = dataclasses.replace(sources[name], dtype="float8_e4m3fn")
    text = refused(qwen3_table(), sources)
    assert f"trainer tensor '{name}' is already fp8; quantizer 'block-linear' takes bf16" in text


def test_a_quantizer_the_engines_block_size_does_not_serve_is_refused():
    text = refused(qwen3_table(), quantizer="per-tensor")
    assert "quantizer 'per-tensor': engine weight_block_size is [128, 128], ours is None" in text
    text = refused(qwen3_table("per-tensor", None), quantizer="block-ue8m0")
    assert "quantizer 'block-ue8m0': engine weight_block_size is None, ours is [128, 128]" in text


def test_a_block_size_the_tp_split_does_not_divide_is_refused_with_sglangs_reason():
    """Qwen3-MoE's experts at TP 4 hold 64 rows: [64, 64] builds, [128, 128] sglang refuses."""
    table = sglang_rank("qwen3_moe", quantizer_of("block-linear", 64), 4, 1, 1)[1]
    config = config_dict("qwen3_moe", quantizer_of("block-linear", 128))
    from p2psync.adapters.sglang.key import config_hash

    text = refused(with_key(table, config=config, config_sha256=config_hash(config)), specs(checkpoint("qwen3_moe")))
    assert "sglang cannot build this rank: " in text and "is not divisible by weight quantization block_n = 128" in text


def test_scale_names_the_engine_does_not_hold_are_refused(monkeypatch):
    table = qwen3_table()
    monkeypatch.setattr(quantizers.Quantizer, "scale_suffix", property(lambda self: "weight_scale_inverse"))
    text = refused(table)
    scale = "model.layers.0.mlp.gate_proj.weight_scale_inverse"
    assert f"the engine holds no scale '{scale}' (quantizer 'block-linear' " in text
    assert "names its scales `...weight_scale_inverse`; sglang's loader refuses it: KeyError" in text


def test_deepseek_per_tensor_is_refused_where_sglang_drops_a_scale():
    """sglang fuses q_a_proj and kv_a_proj_with_mqa into one layer and, with per-tensor scales, keeps
    q_a_proj's scale for both (its loader drops kv_a_proj_with_mqa's): kv_a's weight quantized with
    its own scale would be served with another."""
    table = sglang_rank("deepseek_v3", quantizer_of("per-tensor", None), 1, 1, 0)[1]
    text = refused(table, specs(checkpoint("deepseek_v3")))
    scale = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale"
    assert f"the engine holds no scale '{scale}' (quantizer 'per-tensor' names its scales `...weight_scale`; " \
        "sglang's loader loads it into no parameter; nor 1 more" in text


@pytest.mark.parametrize(
    "post_load,reason",
    [
        ({"deepgemm_ue8m0": True}, "DeepGEMM with UE8M0 scales (SGLANG_ENABLE_JIT_DEEPGEMM on this GPU): sglang "
         "requantizes [128, 128] block scales to powers of two and packs them after loading"),
        ({"platform": "hip"}, "platform 'hip': sglang rewrites fp8 weights after loading there"),
        ({"cpu_amx_engine": True}, "SGLANG_USE_CPU_ENGINE=1: sglang prepacks fp8 weights for AMX after loading"),
    ],
    ids=["deepgemm-ue8m0", "rocm", "cpu-amx"],
)
def test_engines_whose_post_load_rewrites_fp8_weights_are_refused_naming_the_setting(post_load, reason):
    table = qwen3_table()
    assert reason in refused(with_key(table, fp8_post_load={**table.layout_key["fp8_post_load"], **post_load}))


def test_deepgemm_ue8m0_leaves_64_blocks_and_per_tensor_on_cpu_alone_but_not_per_tensor_on_cuda():
    table = qwen3_table("block-linear", 64)
    from p2psync.adapters.sglang.key import rank_spec

    ue8m0 = {**table.layout_key["fp8_post_load"], "deepgemm_ue8m0": True}
    rank_spec(with_key(table, fp8_post_load=ue8m0), require_sglang())
    table = qwen3_table("per-tensor", None)
    rank_spec(table, require_sglang())
    cuda = with_key(table, fp8_post_load={**table.layout_key["fp8_post_load"], "platform": "cuda"})
    assert "per-tensor fp8 on cuda: sglang requantizes fused shards to one scale" in refused(cuda)


def test_an_engine_that_does_not_say_how_it_post_processes_fp8_is_refused():
    text = refused(with_key(qwen3_table(), fp8_post_load=None))
    assert "the engine did not say how sglang processes fp8 weights after loading" in text


def test_online_quantization_of_an_unquantized_checkpoint_is_refused():
    from p2psync.adapters.sglang.key import config_hash

    config = config_dict("qwen3", None)
    table = with_key(qwen3_table(), config=config, config_sha256=config_hash(config), quantization="fp8")
    assert "quantization='fp8' with a checkpoint quantized as None: sglang quantizes while loading" in refused(table)


def test_a_stored_fp8_layout_fills_what_sglangs_load_writes():
    """An fp8 layout through its bytes (`layouts.stored`: what the layout cache keeps and trainer
    ranks exchange) quantizes and fills what sglang's own load of the fp8 checkpoint writes."""
    from p2psync.layouts import stored
    from p2psync.layouts.verify import verify

    quantizer, tensors = quantizer_of("block-linear", 128), checkpoint("qwen3_moe")
    expected, table = sglang_rank("qwen3_moe", quantizer, 2, 2, 1)
    target = SglangEngineTarget(quantizer="block-linear")
    data = stored.encode(target.layout(table, specs(tensors)))
    assert data is not None
    layout = stored.decode(data, table, lambda: target.rank_model(table))
    verify(layout, table, specs(tensors), target)  # what the layout cache checks it against when it reads it
    assert layout.quantizer == quantizer and layout.quantized
    held = produce(layout, tensors, table)
    for param, tensor in expected.items():
        assert torch.equal(held[param], flat_bytes(tensor)), param
