"""Quantizers: turn one trainer HF tensor (bf16/fp16/fp32) into exactly the tensors an fp8
checkpoint holds, the float8_e4m3fn weight and its scale, so an fp8 engine's own loader can
take them.

RL frameworks quantize on the trainer before sending, each with its own function, and these
differ in the last bit (scale = amax/448 or 1/(448/amax); x * (1/scale) or x * (448/amax);
linear or power-of-two scales). An engine fed one framework's bytes and another's would hold
different weights, so each quantizer here is named after the public function it reproduces
bit for bit, op for op, and its docstring says which, and where it knowingly departs.

Each 2-D matrix is quantized on its own: a tensor of shape (..., M, N) is a stack of matrices
(e.g. experts), and no block or per-tensor scale spans two of them. Scales are stored as the
engine multiplies them (dequantized = fp8 * scale): blocks as `<name>_scale_inv` with shape
(..., ceil(M/bm), ceil(N/bn)), per-tensor as `<name>_scale` with shape (...) (a 0-d tensor for
one matrix), the names of DeepSeek-V3's and sglang's fp8 checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..core.errors import P2PSyncError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# slime's kernel stores scale 1.0 for a block whose absmax exceeds this (its `INF`); verl and
# miles do not: above it the references disagree, so no quantizer here serves such a block
LARGEST_ABSMAX = 3.4e38


class QuantizerError(P2PSyncError, ValueError):
    """A tensor a quantizer cannot turn into the reference's bytes, or an engine config it does not serve."""


# --- scale rules: the fp32 absmax of each block -> (scale to store, multiplier for x) ---
ScaleRule = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def _linear_scale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slime/miles `blockwise_cast_to_fp8_triton`, verl `blockwise_cast_to_fp8_triton` (the kernel
    verl's `scaled_fp8_blockwise` runs when triton is there): absmax = max(absmax, 1e-10),
    scale = absmax / 448, multiplier = 1 / scale."""
    absmax = absmax.clamp(min=1e-10)
    # a same-device tensor divisor: torch divides by a Python number on CUDA as a multiplication
    # by its reciprocal, one rounding off; this is an IEEE division on every device
    scale = absmax / torch.full((), FP8_MAX, dtype=torch.float32, device=absmax.device)
    return scale, torch.reciprocal(scale)


def _verl_torch_scale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl 0.9.1 `_scaled_fp8_blockwise_pytorch` (verl.utils.kernel.fp8_kernel; what its
    `scaled_fp8_blockwise` runs without triton or with VERL_DISABLE_TRITON_FP8=1):
    multiplier = 448 / absmax (1 for an all-zero block), scale = 1 / multiplier."""
    multiplier = torch.div(FP8_MAX, absmax)
    multiplier = torch.where(absmax == 0, torch.ones_like(multiplier), multiplier)
    if torch.isinf(multiplier).any():
        # verl would store scale 0 and write +-448 (NaN for zeros) for the whole block
        raise QuantizerError(
            f"a block's absmax is below 448/{torch.finfo(torch.float32).max:.4g}, where verl's torch quantizer "
            "overflows; quantize with 'block-linear' instead"
        )
    return torch.reciprocal(multiplier), multiplier


def _ue8m0_scale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang 0.5.23 `fp8_utils.per_block_cast_to_fp8` (copied there from DeepGEMM):
    absmax = max(absmax, 1e-4), scale = the next power of two >= absmax / 448 (`ceil_to_ue8m0`),
    multiplier = 1.0 / scale (exact). sglang multiplies x in its own dtype by the fp32 multiplier,
    which is the fp32 product we compute, and does not clamp: a power of two >= absmax / 448
    never lets |x| * multiplier exceed 448, so our clamp changes nothing."""
    # a Python-number divisor as in sglang: on CUDA torch multiplies by fl(1/448) instead, which
    # rounds up to the same power of two for every fp32 absmax >= 1e-4 (both roundings depend on
    # the mantissa only; a test checks all 2**23 mantissas)
    scale = _ceil_to_ue8m0(absmax.clamp(min=1e-4) / FP8_MAX)
    return scale, torch.reciprocal(scale)


def _ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0, fp32), from its bits as DeepGEMM does: exponent plus
    one if any mantissa bit is set, clamped to the normal range."""
    bits = x.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def _sglang_tensor_scale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang 0.5.23 `fp8_utils.input_to_float8` (what sglang quantizes a bf16 checkpoint's weights
    with when it serves them as fp8): absmax = max(absmax, 1e-12), multiplier = `448.0 / absmax`
    as torch computes it (Tensor.__rtruediv__: the reciprocal, then times 448), scale = 1 / multiplier."""
    multiplier = torch.reciprocal(absmax.clamp(min=1e-12)) * FP8_MAX
    return torch.reciprocal(multiplier), multiplier


RULES: dict[str, ScaleRule] = {
    "block-linear": _linear_scale,
    "block-linear-verl-torch": _verl_torch_scale,
    "block-ue8m0": _ue8m0_scale,
    "per-tensor": _sglang_tensor_scale,
}
PER_TENSOR = ("per-tensor",)
NAMES = tuple(RULES)
DEFAULT_BLOCK = (128, 128)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., M, N) -> (fp8 weight (..., M, N), fp32 scale (..., ceil(M/bm), ceil(N/bn))).

    As every reference does: zero-pad to whole blocks, take each block's absmax in fp32, then
    q = clamp(fp32(x) * multiplier, -448, 448) rounded to e4m3 (torch's round-to-nearest-even,
    the same code on CPU and CUDA)."""
    *lead, m, n = x.shape
    bm, bn = block
    pm, pn = -m % bm, -n % bn
    padded = torch.nn.functional.pad(x, (0, pn, 0, pm)) if pm or pn else x
    blocks = padded.reshape(-1, (m + pm) // bm, bm, (n + pn) // bn, bn)
    absmax = blocks.abs().amax(dim=(2, 4), keepdim=True).float()  # a max is exact in any dtype
    _check_finite(absmax)
    scale, multiplier = rule(absmax)
    weight = (blocks.float() * multiplier).clamp_(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    weight = weight.reshape(*lead, m + pm, n + pn)[..., :m, :n].contiguous()
    return weight, scale[:, :, 0, :, 0].reshape(*lead, (m + pm) // bm, (n + pn) // bn)


def _check_finite(absmax: torch.Tensor) -> None:
    bad = ~(absmax <= LARGEST_ABSMAX)  # NaN compares false
    if bad.any():
        matrix, row, _, col, _ = (int(i) for i in bad.nonzero()[0])
        raise QuantizerError(
            f"block ({row}, {col}) of matrix {matrix} has absmax {absmax[matrix, row, 0, col, 0].item()!r}: "
            f"inf/nan or above {LARGEST_ABSMAX:g}, where the reference quantizers disagree or produce NaN"
        )


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """A named quantization rule and its block size ([rows, cols]; None: one scale per matrix)."""

    name: str
    block: tuple[int, int] | None

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.block else "weight_scale"

    def scale_name(self, hf_name: str) -> str:
        """The checkpoint name of `hf_name`'s scale: `...weight` -> `...weight_scale_inv` (blocks)
        or `...weight_scale` (per tensor)."""
        if not hf_name.endswith("weight"):
            raise QuantizerError(
                f"quantizer {self.name!r}: {hf_name!r} is not a weight; only `...weight` tensors are quantized"
            )
        return hf_name[: -len("weight")] + self.scale_suffix

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the scale `quantize` gives a tensor of `shape` (..., M, N)."""
        *lead, m, n = shape
        if self.block is None:
            return tuple(lead)
        return (*lead, -(-m // self.block[0]), -(-n // self.block[1]))

    def quantize(self, hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{hf_name: float8_e4m3fn weight, scale name: float32 scale}, on `tensor`'s device."""
        scale_name = self.scale_name(hf_name)
        if tensor.dtype not in INPUT_DTYPES:
            fp8 = tensor.dtype.itemsize == 1 and tensor.is_floating_point()
            what = "is already fp8" if fp8 else f"is {tensor.dtype}"
            raise QuantizerError(
                f"quantizer {self.name!r}: {hf_name!r} {what}; the trainer must send bf16, fp16 or fp32 tensors"
            )
        if tensor.dim() < 2:
            raise QuantizerError(
                f"quantizer {self.name!r}: {hf_name!r} has shape {tuple(tensor.shape)}; fp8 weights are matrices"
            )
        block = self.block or (tensor.shape[-2], tensor.shape[-1])
        try:
            weight, scale = quantize_blocks(tensor, block, RULES[self.name])
        except QuantizerError as exc:
            raise QuantizerError(f"quantizer {self.name!r}: {hf_name!r}: {exc}") from None
        return {hf_name: weight, scale_name: scale if self.block else scale.reshape(tensor.shape[:-2])}

    def quantize_from(self, hf_name: str, tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`quantize` of `tensor` cast to `dtype` (the engine's unquantized dtype) first: the bytes of
        quantizing the checkpoint the engine would serve unquantized, as verl does (`v.to(bf16)`
        before its quantizer), whatever dtype the trainer holds. Every sender of an fp8 update
        quantizes through here, so that all of them send the same bytes."""
        return self.quantize(hf_name, tensor.to(dtype))

    def quantization_config(self) -> dict[str, Any]:
        """The HF `quantization_config` of a checkpoint holding this quantizer's tensors."""
        config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if self.block:
            config["weight_block_size"] = list(self.block)
        return config

    def check_serves(self, engine_config: Mapping[str, Any] | None) -> None:
        """Raise, naming the field, unless an engine with this `quantization_config` loads our tensors as they are."""
        me = f"quantizer {self.name!r}"
        if not engine_config:
            raise QuantizerError(f"{me}: the engine has no quantization_config (it does not serve fp8)")
        if engine_config.get("quant_method") != "fp8":
            raise QuantizerError(f"{me}: engine quant_method is {engine_config.get('quant_method')!r}, not 'fp8'")
        if engine_config.get("fmt", "e4m3") != "e4m3":
            raise QuantizerError(f"{me}: engine fmt is {engine_config.get('fmt')!r}; ours is 'e4m3'")
        if engine_config.get("activation_scheme") != "dynamic":
            raise QuantizerError(
                f"{me}: engine activation_scheme is {engine_config.get('activation_scheme')!r}; "
                "only 'dynamic' (no input scales to send) is served"
            )
        theirs = engine_config.get("weight_block_size")
        ours = list(self.block) if self.block else None
        if (list(theirs) if theirs is not None else None) != ours:
            raise QuantizerError(f"{me}: engine weight_block_size is {theirs!r}, ours is {ours!r}")


def get(name: str, block: Sequence[int] | None = None) -> Quantizer:
    """The quantizer `name` (one of NAMES); block quantizers take `block` [rows, cols] (default
    [128, 128]), `per-tensor` takes none."""
    if name not in RULES:
        raise QuantizerError(f"unknown quantizer {name!r}; valid: {', '.join(NAMES)}")
    if name in PER_TENSOR:
        if block is not None:
            raise QuantizerError(f"quantizer {name!r} takes no block size (got {list(block)!r})")
        return Quantizer(name, None)
    block = DEFAULT_BLOCK if block is None else block
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise QuantizerError(f"quantizer {name!r} needs a block size [rows, cols] of two positive ints, not {block!r}")
    return Quantizer(name, (block[0], block[1]))


def for_engine(engine_config: Mapping[str, Any], name: str | None = None) -> Quantizer:
    """The quantizer for an engine serving `engine_config` (its HF `quantization_config`): `name`,
    or by default `block-linear` at the engine's `weight_block_size` (absmax / 448 scales: what
    slime, miles and verl send, and what DeepSeek-V3's and Qwen3's fp8 checkpoints hold, which
    the engines load as they are) or `per-tensor` where the engine has no block size. Raises
    QuantizerError where the engine does not load its tensors as they are (`check_serves`)."""
    block = engine_config.get("weight_block_size")
    if name is None:
        name = "block-linear" if block is not None else "per-tensor"
    quantizer = get(name, None if name in PER_TENSOR else (list(block) if block is not None else None))
    quantizer.check_serves(engine_config)
    return quantizer
