"""fp8 quantizers, bit for bit against the public functions each one is named after.

Which environment runs what (tox.ini):
- py: everything that needs torch only: the linear kernels' op order written out per block,
  shapes and names, stacks of matrices, errors, configs, the UE8M0 device argument;
  the reference comparisons skip there, each with its reason.
- conformance-sglang: against sglang 0.5.23's `per_block_cast_to_fp8` and `input_to_float8`.
- integrations: against verl 0.9.1's `_scaled_fp8_blockwise_pytorch` (and, on a CUDA machine,
  its triton `blockwise_cast_to_fp8_triton`).
slime's and miles' kernels are not on PyPI; on a CUDA machine where they are importable they
are compared too, else the test says why it skips.

Inputs are awkward on purpose: rows and columns that are not multiples of the block, all-zero
blocks and matrices, one element, extremes (near the dtype's largest finite value, tiny and
subnormal blocks), and values within a few ulps of `scale * m` for every e4m3 rounding midpoint
m, where a different op order (x / scale instead of x * (1 / scale), 448 / amax instead of
1 / (amax / 448)) rounds to a different fp8 value.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from p2psync.layouts import quantizers
from p2psync.layouts.quantizers import QuantizerError

FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float32)
BLOCKS = ((128, 128), (64, 64))
TINY = "tiny blocks"  # absmax below 448 / the largest fp32: verl's torch path overflows there


def _e4m3_midpoints() -> torch.Tensor:
    """Every value halfway between two adjacent non-negative finite e4m3 values."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0x7F is NaN
    return (values[:-1] + values[1:]) / 2


def _near_midpoints(amax: float, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """One block whose absmax is `amax` (its first element), the rest within 4 ulps (of `dtype`)
    of amax/448 times each e4m3 midpoint, both signs, repeated to fill the block."""
    scaled = (_e4m3_midpoints().double() * (amax / 448.0)).to(dtype)
    bits = scaled.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
    near = torch.cat([(bits + k).view(dtype) for k in range(-4, 5)])
    near = near[(near.float().abs() < amax) & (near != 0)]
    body = torch.cat([near, -near])
    n = block[0] * block[1]
    out = body.repeat(n // body.numel() + 1)[:n].clone()
    out[0] = amax
    return out.reshape(block)


def awkward(dtype: torch.dtype, block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, matrix) pairs, fixed seed."""
    g = torch.Generator().manual_seed(17)
    big = torch.finfo(dtype).max
    bm, bn = block
    for m, n in ((2 * bm + 44, bn + 72), (1, 1), (bm + 1, 2 * bn + 1), (bm // 2, 7 * bn + 3)):
        rows = torch.rand(m, 1, generator=g) * 4
        yield f"random {m}x{n}", (torch.randn(m, n, generator=g) * rows).to(dtype)
    x = torch.randn(2 * bm + 5, 2 * bn + 9, generator=g).to(dtype)
    x[:bm, bn:] = 0
    x[-3:, :] = 0  # the last block row: 3 zero rows, the rest padding
    yield "zero blocks", x
    yield "all zero", torch.zeros(bm + 3, bn, dtype=dtype)
    x = torch.randn(2 * bm, 2 * bn, generator=g)
    x[:bm, :bn] *= big / 8  # the first block reaches about half the largest finite value
    x[:bm, :bn].clamp_(-big, big)
    x[bm:, :bn] *= 1e-30  # small, and 448 / absmax still finite
    x[bm:, bn:] *= 1e-3
    x[:bm, bn:] = big / 2  # a block of equal values
    yield "extremes", x.to(dtype)
    x = torch.randn(bm, 3 * bn, generator=g)
    x[:, :bn] = x[:, :bn].sign() * torch.finfo(dtype).tiny  # the smallest normal value
    x[:, bn : 2 * bn] *= 1e-40  # subnormal in both dtypes (bf16 and fp32 share the exponent range)
    yield TINY, x.to(dtype)
    midpoint_blocks = [[_near_midpoints(a, block, dtype) for a in row] for row in ((0.7321, 3.1e-3), (1.0, 61.7))]
    yield "near e4m3 midpoints", torch.cat([torch.cat(row, dim=1) for row in midpoint_blocks], dim=0)


def cases(blocks: tuple[tuple[int, int], ...] = BLOCKS, without: tuple[str, ...] = ()):
    return [
        pytest.param(dtype, block, label, x, id=f"{str(dtype)[6:]}-{block[0]}x{block[1]}-{label}")
        for dtype in DTYPES
        for block in blocks
        for label, x in awkward(dtype, block)
        if label not in without
    ]


def assert_same_bytes(
    ours: dict[str, torch.Tensor], name: str, ref_weight: torch.Tensor, ref_scale: torch.Tensor, scale_name: str
) -> None:
    weight, scale = ours[name], ours[scale_name]
    assert weight.dtype == FP8 and ref_weight.dtype == FP8
    assert weight.shape == ref_weight.shape, (weight.shape, ref_weight.shape)
    assert scale.dtype == ref_scale.dtype == torch.float32
    assert scale.shape == ref_scale.shape, (scale.shape, ref_scale.shape)
    differ = (weight.view(torch.uint8) != ref_weight.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} of {weight.numel()} fp8 bytes differ from the reference"
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), "scales differ from the reference"


# --- the references ---


def _sglang_fp8_utils():
    return pytest.importorskip(
        "sglang.srt.layers.quantization.fp8_utils",
        reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`",
    )


VERL_MISSING = "verl (p2psync[verl], verl==0.9.1) is not installed; run `tox -e integrations`"


def _verl_fp8_kernel():
    return pytest.importorskip("verl.utils.kernel.fp8_kernel", reason=VERL_MISSING)


@pytest.mark.parametrize("dtype,block,label,x", cases(((128, 128),)))
def test_block_ue8m0_equals_sglang_per_block_cast_to_fp8(dtype, block, label, x):
    fp8_utils = _sglang_fp8_utils()
    ref_weight, ref_scale = fp8_utils.per_block_cast_to_fp8(x)  # sglang's is [128, 128] only
    ours = quantizers.get("block-ue8m0", block).quantize("w.weight", x)
    assert_same_bytes(ours, "w.weight", ref_weight, ref_scale, "w.weight_scale_inv")


@pytest.mark.parametrize("dtype,block,label,x", cases(((128, 128),)))
def test_per_tensor_equals_sglang_input_to_float8(dtype, block, label, x):
    fp8_utils = _sglang_fp8_utils()
    ref_weight, ref_scale = fp8_utils.input_to_float8(x)
    ours = quantizers.get("per-tensor").quantize("w.weight", x)
    assert_same_bytes(ours, "w.weight", ref_weight, ref_scale, "w.weight_scale")


@pytest.mark.parametrize("dtype,block,label,x", cases(without=(TINY,)))
def test_block_linear_verl_torch_equals_verl_pytorch_path(dtype, block, label, x):
    kernel = _verl_fp8_kernel()
    ref_weight, ref_scale = kernel._scaled_fp8_blockwise_pytorch(x, list(block))
    ours = quantizers.get("block-linear-verl-torch", block).quantize("w.weight", x)
    # verl's FP8QuantizerHelper squeezes the (BLK_M, BLK_N, 1) scale before sending it
    assert_same_bytes(ours, "w.weight", ref_weight, ref_scale.squeeze(-1), "w.weight_scale_inv")


LINEAR_KERNELS = {
    "verl": ("verl.utils.kernel.fp8_kernel", VERL_MISSING),
    "slime": ("slime.utils.fp8_kernel", "slime is not on PyPI (github.com/THUDM/slime, slime/utils/fp8_kernel.py)"),
    "miles": ("miles.utils.fp8_kernel", "miles is not on PyPI (github.com/radixark/miles, miles/utils/fp8_kernel.py)"),
}


@pytest.mark.parametrize("framework", list(LINEAR_KERNELS))
@pytest.mark.parametrize("dtype,block,label,x", cases())
def test_block_linear_equals_the_triton_kernels(framework, dtype, block, label, x):
    """slime's, miles' and verl's `blockwise_cast_to_fp8_triton`, run where they run: on CUDA."""
    module, reason = LINEAR_KERNELS[framework]
    kernel = pytest.importorskip(module, reason=reason)
    if not torch.cuda.is_available():
        pytest.skip(
            "the triton kernels need a CUDA device; triton's CPU interpreter (TRITON_INTERPRET=1) is no reference: "
            "it rounds to e4m3 by adding the first cut-off bit (not round-to-nearest-even), and on NVIDIA GPUs "
            "triton divides fp32 with div.full.f32 (approximate), so equality there is a GPU-only fact; "
            "test_block_linear_follows_the_kernels_op_order checks the op order on CPU"
        )
    xc = x.cuda()
    pad = (0, -x.shape[1] % block[1], 0, -x.shape[0] % block[0])
    ref_weight, ref_scale = kernel.blockwise_cast_to_fp8_triton(torch.nn.functional.pad(xc, pad), list(block))
    ours = quantizers.get("block-linear", block).quantize("w.weight", xc)
    assert_same_bytes(ours, "w.weight", ref_weight[: x.shape[0], : x.shape[1]], ref_scale, "w.weight_scale_inv")


def _kernel_op_order(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The op order of `_blockwise_cast_to_fp8_triton` in slime/utils/fp8_kernel.py (THUDM/slime,
    force_pow_2_scale=False), miles/utils/fp8_kernel.py (radixark/miles) and
    verl/utils/kernel/fp8_kernel.py (verl 0.9.1), one block at a time, in IEEE fp32 as on a CPU:
    x = fp32(load(block, other=0)); absmax = maximum(max(|x|), 1e-10); x_s = absmax / 448;
    s_inv = 1.0 / x_s; y = clamp(x * s_inv, -448, 448) to e4m3; store x_s."""
    m, n = x.shape
    bm, bn = block
    weight = torch.empty(m, n, dtype=FP8)
    scale = torch.empty(-(-m // bm), -(-n // bn), dtype=torch.float32)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for i, j in itertools.product(range(scale.shape[0]), range(scale.shape[1])):
        xb = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].to(torch.float32)
        absmax = torch.maximum(xb.abs().max(), f32(1e-10))
        x_s = absmax / f32(448.0)
        s_inv = f32(1.0) / x_s
        weight[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = torch.clamp(xb * s_inv, -448.0, 448.0).to(FP8)
        scale[i, j] = x_s
    return weight, scale


@pytest.mark.parametrize("dtype,block,label,x", cases())
def test_block_linear_follows_the_kernels_op_order(dtype, block, label, x):
    ref_weight, ref_scale = _kernel_op_order(x, block)
    ours = quantizers.get("block-linear", block).quantize("w.weight", x)
    assert_same_bytes(ours, "w.weight", ref_weight, ref_scale, "w.weight_scale_inv")


# --- what holds for every quantizer, without a reference ---

QUANTIZERS = [
    ("block-linear", (128, 128)),
    ("block-linear-verl-torch", (64, 64)),
    ("block-ue8m0", (128, 128)),
    ("per-tensor", None),
]


@pytest.mark.parametrize("name,block", QUANTIZERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_weight_is_within_e4m3_rounding(name, block, dtype):
    """q * scale is x up to e4m3's rounding: half an ulp (2**-4 relative) for normal values, and
    half the smallest subnormal step (2**-10 * scale) below them."""
    for label, x in awkward(dtype, block or (128, 128)):
        if not (label == TINY and name == "block-linear-verl-torch"):
            _assert_dequantizes_to(name, block, x)


def _assert_dequantizes_to(name: str, block: tuple[int, int] | None, x: torch.Tensor) -> None:
    out = quantizers.get(name, block).quantize("w.weight", x)
    scale = out["w.weight_scale_inv" if block else "w.weight_scale"]
    if block:
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: x.shape[0], : x.shape[1]]
    dequantized = out["w.weight"].float() * scale
    tolerance = x.float().abs() * 2**-4 + scale * 2**-10
    assert (dequantized - x.float()).abs().le(tolerance * 1.0001).all()


@pytest.mark.parametrize("name,block", QUANTIZERS)
def test_a_stack_of_matrices_is_quantized_matrix_by_matrix(name, block):
    g = torch.Generator().manual_seed(3)
    experts = torch.randn(3, 200, 136, generator=g).to(torch.bfloat16) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    quantizer = quantizers.get(name, block)
    scale_name = quantizer.scale_name("e.weight")
    stacked = quantizer.quantize("e.weight", experts)
    one_by_one = [quantizer.quantize("e.weight", e) for e in experts]
    one_by_one_weights = torch.stack([o["e.weight"] for o in one_by_one])
    assert torch.equal(stacked["e.weight"].view(torch.uint8), one_by_one_weights.view(torch.uint8))
    assert torch.equal(stacked[scale_name], torch.stack([o[scale_name] for o in one_by_one]))
    expected_scale_shape = (3, 2, 2) if block == (128, 128) else (3, 4, 3) if block == (64, 64) else (3,)
    assert stacked[scale_name].shape == expected_scale_shape


@pytest.mark.parametrize("name,block,scale_name,scale_shape", [
    ("block-linear", (128, 128), "model.layers.0.mlp.down_proj.weight_scale_inv", (3, 2)),
    ("block-linear", (64, 64), "model.layers.0.mlp.down_proj.weight_scale_inv", (5, 3)),
    ("block-ue8m0", (128, 128), "model.layers.0.mlp.down_proj.weight_scale_inv", (3, 2)),
    ("per-tensor", None, "model.layers.0.mlp.down_proj.weight_scale", ()),
])
def test_names_shapes_and_dtypes_an_fp8_checkpoint_holds(name, block, scale_name, scale_shape):
    x = torch.randn(300, 130, dtype=torch.bfloat16)
    out = quantizers.get(name, block).quantize("model.layers.0.mlp.down_proj.weight", x)
    assert list(out) == ["model.layers.0.mlp.down_proj.weight", scale_name]
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert out["model.layers.0.mlp.down_proj.weight"].shape == (300, 130)
    assert out[scale_name].dtype == torch.float32 and out[scale_name].shape == scale_shape


def test_ue8m0_scale_is_the_same_power_of_two_whether_torch_divides_or_multiplies_by_the_reciprocal():
    """sglang divides absmax by the Python number 448.0; torch does that as an IEEE division on CPU
    and as absmax * fl(1/448) on CUDA. Rounded up to a power of two the two agree for every fp32
    absmax: both roundings depend on the mantissa only, so all 2**23 mantissas (at one exponent,
    and at the 1e-4 clamp's) cover every absmax the quantizer sees."""
    mantissas = torch.arange(2**23, dtype=torch.int32)
    for exponent in (127, 113):  # absmax in [1, 2) and in [2**-14, 2**-13), around 1e-4
        absmax = ((exponent << 23) | mantissas).view(torch.float32)
        divided = absmax / torch.tensor(448.0)
        multiplied = absmax * torch.reciprocal(torch.tensor(448.0))
        assert not torch.equal(divided, multiplied)  # the two roundings do differ somewhere
        assert torch.equal(quantizers._ceil_to_ue8m0(divided), quantizers._ceil_to_ue8m0(multiplied))


# --- what is refused, and why ---


@pytest.mark.parametrize("tensor,message", [
    (torch.zeros(4, 4, dtype=FP8), "is already fp8"),
    (torch.zeros(4, 4, dtype=torch.float8_e5m2), "is already fp8"),
    (torch.zeros(4, 4, dtype=torch.int8), "is torch.int8"),
    (torch.zeros(4, 4, dtype=torch.float64), "is torch.float64"),
    (torch.zeros(16), "fp8 weights are matrices"),
])
def test_what_is_not_a_trainer_matrix_is_refused(tensor, message):
    with pytest.raises(QuantizerError, match=message):
        quantizers.get("block-linear").quantize("model.layers.0.self_attn.q_proj.weight", tensor)


def test_only_weights_are_quantized():
    with pytest.raises(QuantizerError, match="'model.layers.0.self_attn.q_proj.bias' is not a weight"):
        quantizers.get("block-ue8m0").quantize("model.layers.0.self_attn.q_proj.bias", torch.zeros(4, 4))


@pytest.mark.parametrize("name,block", QUANTIZERS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 3.4028e38])
def test_non_finite_or_too_large_blocks_are_refused_naming_the_block(name, block, bad):
    x = torch.ones(200, 200)
    x[150, 70] = bad
    where = "block \\(0, 0\\)" if block is None else f"block \\({150 // block[0]}, {70 // block[1]}\\)"
    with pytest.raises(QuantizerError, match=f"'w.weight': {where} of matrix 0 has absmax"):
        quantizers.get(name, block).quantize("w.weight", x)


def test_verl_torch_refuses_blocks_where_verls_own_function_overflows():
    x = torch.ones(128, 256)
    x[:, 128:] = 1e-37  # 448 / 1e-37 overflows fp32
    with pytest.raises(QuantizerError, match="verl's torch quantizer overflows; quantize with 'block-linear'"):
        quantizers.get("block-linear-verl-torch").quantize("w.weight", x)
    # the other linear rule serves the same tensor
    out = quantizers.get("block-linear").quantize("w.weight", x)
    assert torch.isfinite(out["w.weight"].float()).all() and (out["w.weight_scale_inv"] > 0).all()


@pytest.mark.parametrize("name,block,message", [
    ("block-absmax", None,
     "unknown quantizer 'block-absmax'; valid: block-linear, block-linear-verl-torch, block-ue8m0, per-tensor"),
    ("block-linear", (128,), "needs a block size"),
    ("block-linear", (0, 128), "needs a block size"),
    ("block-linear", (128.0, 128), "needs a block size"),
    ("per-tensor", (128, 128), "takes no block size"),
])
def test_bad_names_and_block_sizes_are_refused(name, block, message):
    with pytest.raises(QuantizerError, match=message):
        quantizers.get(name, block)


def test_default_block_is_128():
    assert quantizers.get("block-linear").block == (128, 128)


# --- the quantization config each quantizer stands for ---

DYNAMIC_E4M3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


@pytest.mark.parametrize("name,block,config", [
    ("block-linear", (128, 128), {**DYNAMIC_E4M3, "weight_block_size": [128, 128]}),
    ("block-ue8m0", (64, 64), {**DYNAMIC_E4M3, "weight_block_size": [64, 64]}),
    ("per-tensor", None, DYNAMIC_E4M3),
])
def test_quantization_config_is_what_the_engine_serves(name, block, config):
    quantizer = quantizers.get(name, block)
    assert quantizer.quantization_config() == config
    quantizer.check_serves(config)
    quantizer.check_serves({**config, "ignored_layers": ["lm_head"]})  # which layers are fp8 is the engine's business


@pytest.mark.parametrize("engine_config,message", [
    (None, "has no quantization_config"),
    ({"quant_method": "awq"}, "quant_method is 'awq'"),
    ({**DYNAMIC_E4M3, "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt is 'e5m2'"),
    ({**DYNAMIC_E4M3, "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme is 'static'"),
    ({**DYNAMIC_E4M3, "weight_block_size": [64, 64]}, r"weight_block_size is \[64, 64\], ours is \[128, 128\]"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"weight_block_size is None, ours is \[128, 128\]"),
])
def test_engine_configs_a_quantizer_does_not_serve_are_refused(engine_config, message):
    with pytest.raises(QuantizerError, match=message):
        quantizers.get("block-linear").check_serves(engine_config)


def test_per_tensor_does_not_serve_a_block_engine():
    with pytest.raises(QuantizerError, match=r"weight_block_size is \[128, 128\], ours is None"):
        quantizers.get("per-tensor").check_serves(quantizers.get("block-linear").quantization_config())

