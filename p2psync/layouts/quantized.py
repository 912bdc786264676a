"""The layout of an fp8 engine rank: quantize on the sender, then the engine's own layout.

An fp8 engine's loader takes an fp8 checkpoint: each quantized weight as float8_e4m3fn plus
its scale. The trainer holds bf16 (or fp32) HF tensors, so the sender quantizes each HF tensor
that feeds an fp8 parameter with a named quantizer (`quantizers`), and an `EngineLayout` over
the quantized tensors does the rest: copy maps where the loader only copies (phase 1 found
sglang's and vLLM's fp8 loads are pure copies, scales included), the engine's loader per
parameter where it does more.

Which HF tensors to quantize comes from the engine, not from names: a trace of the loader on
meta says which HF tensors feed which parameter, and those that feed a float8 parameter are
quantized (vLLM quantizes Qwen3-MoE's router gate, which sglang keeps bf16).

Quantizer inputs are first cast to the engine's dtype (bf16): the bytes are then those of
quantizing the checkpoint the engine would serve unquantized, as verl does (`v.to(bf16)` before
its quantizer), whatever dtype the trainer holds; and gathers may move bf16 instead of fp32
(`copy_dtype` says the engine dtype, never fp8: quantization is not a cast). Blocks span
trainer shards, so a quantized group is always gathered (`copy_runs` is None).

A rank reads only its shard of each tensor, and block scales make every block independent of
the others: where the layout only copies, the sender quantizes just the blocks holding what
the rank reads (a TP rank of N, about 1/N of each matrix) and leaves the rest of the
quantized tensor unwritten, which nothing reads (`_box`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from ..core.errors import ConnectError, where
from ..core.layout import CopyRun, Layout, ParamGroup
from ..core.types import ParamSpec, Region, TargetTable
from .copymap import Block, read_box
from .layout import EngineLayout, LoaderRefusal, Mode, traced_loader
from .trace import LoaderTrace
from .quantizers import FP8_DTYPE, INPUT_DTYPES, Quantizer, QuantizerError
from .rank_model import RankModel

log = logging.getLogger(__name__)


def _feeds(
    table: TargetTable, rank_model: RankModel, params: Mapping[str, torch.Tensor], sources: Mapping[str, ParamSpec]
) -> dict[str, set[str]]:
    """Which HF tensors feed which parameter, traced with every weight matrix presented in fp8, as
    an fp8 checkpoint may hold it: some loaders refuse to cast a wider tensor into an fp8 parameter
    (sglang's `copy_with_check`). Traced as the trainer holds them where the loader refuses that,
    which raises ConnectError naming the tensor the loader refuses."""
    fp8 = str(FP8_DTYPE).removeprefix("torch.")
    presented = {
        name: ParamSpec(name, spec.shape, fp8) if len(spec.shape) >= 2 and name.endswith("weight") else spec
        for name, spec in sources.items()
    }
    try:
        return traced_loader(table, rank_model, params, presented).feeds
    except ConnectError:
        return traced_loader(table, rank_model, params, sources).feeds


class QuantizedLayout(Layout):
    """The bytes of one fp8 engine rank from the trainer's HF tensors: those feeding fp8
    parameters quantized by `quantizer` (after a cast to `dtype`, the engine's unquantized
    dtype), then `EngineLayout` in `mode` over the quantized tensors.

    A weight and its scale are produced in one group (q, k, v -> `qkv_proj.weight` and
    `qkv_proj.weight_scale_inv`). Raises ConnectError, naming engine, rank and tensor, for a
    trainer tensor that is already fp8 (or not a weight), an HF tensor feeding both fp8 and
    unquantized parameters, and a scale the engine's loader loads into no parameter.
    """

    def __init__(
        self, table: TargetTable, sources: Mapping[str, ParamSpec], rank_model: RankModel, *,
        mode: Mode, quantizer: Quantizer, dtype: torch.dtype,
    ) -> None:
        self.table, self.quantizer, self.dtype = table, quantizer, dtype
        params = dict(rank_model.model.named_parameters())
        self.quantized = self._to_quantize(_feeds(table, rank_model, params, sources), params, sources)
        together = [(name, quantizer.scale_name(name)) for name in sources if name in self.quantized]
        checkpoint = self.checkpoint_specs(sources)
        trace = self._scales_loaded(rank_model, params, checkpoint, [scale for _, scale in together])
        self.inner = EngineLayout(table, checkpoint, rank_model, mode=mode, together=together, trace=trace)
        self._index()
        log.info(
            "%s: %d HF tensors quantized by %r (block %s) before the layout",
            where(table.engine_id, table.rank), len(self.quantized), quantizer.name, quantizer.block,
        )

    @classmethod
    def restored(
        cls, table: TargetTable, inner: EngineLayout, quantizer: Quantizer, dtype: torch.dtype, quantized: frozenset[str]
    ) -> QuantizedLayout:
        """The layout compiled before around `inner` (see `stored`): nothing is compiled."""
        layout = cls.__new__(cls)
        layout.table, layout.quantizer, layout.dtype, layout.quantized, layout.inner = table, quantizer, dtype, quantized, inner
        layout._index()
        return layout

    def _index(self) -> None:
        """The inner layout's groups, read from the trainer's tensors: a scale is made from its weight;
        and what the inner layout's copies read of each input (`_box`)."""
        scales = {self.quantizer.scale_name(name) for name in self.quantized}
        self._inner_of = {g.outputs: g for g in self.inner.groups()}
        self._groups = [
            ParamGroup(tuple(n for n in g.inputs if n not in scales), g.outputs, g.nbytes) for g in self.inner.groups()
        ]
        self._reads: dict[str, list[Block]] = {}
        self._loader_read: set[str] = set()
        for group in self.inner.groups():
            reads = self.inner.reads(group)
            for name in group.inputs:
                if reads is None:
                    self._loader_read.add(name)
                else:
                    self._reads.setdefault(name, []).extend(reads.get(name, []))
        self._boxes: dict[str, tuple[int, int, int, int] | None] = {}

    def _box(self, name: str, shape: Sequence[int]) -> tuple[int, int, int, int] | None:
        """(rows, columns) of quantized matrix `name` that this rank's copies read, weight and
        scale, widened to whole quantizer blocks: the part the sender quantizes. None where that
        is the whole matrix, the quantizer has one scale per matrix, or the engine's loader
        reads the weight or its scale."""
        if name in self._boxes:
            return self._boxes[name]
        scale, block = self.quantizer.scale_name(name), self.quantizer.block
        box = None
        if block is not None and len(shape) == 2 and not {name, scale} & self._loader_read:
            (m, n), (bm, bn) = shape, block
            r0, r1, c0, c1 = read_box(self._reads.get(name, []), m, n)
            s0, s1, t0, t1 = read_box(self._reads.get(scale, []), -(-m // bm), -(-n // bn))
            r0, r1, c0, c1 = min(r0, s0 * bm), max(r1, s1 * bm), min(c0, t0 * bn), max(c1, t1 * bn)
            widened = (r0 // bm * bm, min(m, -(-r1 // bm) * bm), c0 // bn * bn, min(n, -(-c1 // bn) * bn))
            if widened[0] < widened[1] and widened[2] < widened[3] and widened != (0, m, 0, n):
                box = widened
        self._boxes[name] = box
        return box

    # -- what the tests and the session read ---------------------------------------------------

    @property
    def loader_params(self) -> list[str]:
        """Parameters the engine's loader produces at every update (not a copy map)."""
        return self.inner.loader_params

    @property
    def rank_model(self) -> RankModel | None:
        return self.inner.rank_model

    def regions_of(self, name: str) -> list[Region]:
        """The regions of parameter `name`, with buffer offsets relative to its group's bytes."""
        return self.inner.regions_of(name)

    def groups(self) -> Sequence[ParamGroup]:
        return self._groups

    def left_alone(self) -> Sequence[str]:
        return self.inner.left_alone()

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        inputs: dict[str, torch.Tensor] = {}
        for name in group.inputs:
            if name in self.quantized:
                inputs.update(self._quantize(name, tensors[name]))
            else:
                inputs[name] = tensors[name]
        return self.inner.fill(self._inner_of[group.outputs], inputs, out)

    def _quantize(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fp8 weight and scale of HF tensor `name`: whole, or only the blocks of its box,
        in place in tensors of the whole shapes whose other elements are left unwritten."""
        box = self._box(name, tensor.shape)
        if box is None:
            return self.quantizer.quantize_from(name, tensor, self.dtype)
        assert self.quantizer.block is not None  # boxes are only made for block quantizers
        (r0, r1, c0, c1), (bm, bn) = box, self.quantizer.block
        part = self.quantizer.quantize_from(name, tensor[r0:r1, c0:c1], self.dtype)
        scale_name = self.quantizer.scale_name(name)
        weight = torch.empty(tensor.shape, dtype=FP8_DTYPE, device=tensor.device)
        weight[r0:r1, c0:c1] = part[name]
        scale_shape = self.quantizer.scale_shape(tensor.shape)
        scale = torch.empty(scale_shape, dtype=part[scale_name].dtype, device=tensor.device)
        scale[r0 // bm : -(-r1 // bm), c0 // bn : -(-c1 // bn)] = part[scale_name]
        return {name: weight, scale_name: scale}

    def copy_dtype(self, group: ParamGroup) -> str | None:
        """The engine dtype where every input is quantized (the fill casts to it first; never the
        fp8 dtype: quantization is not a cast); the inner layout's answer where none is."""
        if not self._is_quantized(group):
            return self.inner.copy_dtype(self._inner_of[group.outputs])
        if all(name in self.quantized for name in group.inputs):
            return str(self.dtype).removeprefix("torch.")
        return None

    def copy_runs(self, group: ParamGroup, held: Mapping[str, Sequence[tuple[int, int]]]) -> list[CopyRun] | None:
        """None for a quantized group: a block's scale needs the whole block, which trainer shards
        split; the inner layout's runs where nothing is quantized."""
        if self._is_quantized(group):
            return None
        return self.inner.copy_runs(self._inner_of[group.outputs], held)

    def fill_constants(self, group: ParamGroup, out: torch.Tensor) -> list[Region]:
        if self._is_quantized(group):
            return []
        return self.inner.fill_constants(self._inner_of[group.outputs], out)

    def has_constants(self, group: ParamGroup) -> bool:
        return not self._is_quantized(group) and self.inner.has_constants(self._inner_of[group.outputs])

    # -- compile -------------------------------------------------------------------------------

    def _is_quantized(self, group: ParamGroup) -> bool:
        return any(name in self.quantized for name in group.inputs)

    def _to_quantize(
        self, feeds: Mapping[str, set[str]], params: Mapping[str, torch.Tensor], sources: Mapping[str, ParamSpec]
    ) -> frozenset[str]:
        """The HF tensors feeding fp8 parameters; each must be a trainer weight in a quantizer input dtype."""
        t = self.table
        fp8 = {hf for param, hfs in feeds.items() if params[param].dtype == FP8_DTYPE for hf in hfs}
        plain = {hf for param, hfs in feeds.items() if params[param].dtype != FP8_DTYPE for hf in hfs}
        for name in sorted(fp8):
            if name in plain:
                both = sorted(p for p, hfs in feeds.items() if name in hfs)
                raise ConnectError(
                    f"{where(t.engine_id, t.rank)}: HF tensor {name!r} feeds fp8 and unquantized parameters "
                    f"({', '.join(both)}); it cannot be both quantized and not"
                )
            dtype = sources[name].dtype
            if getattr(torch, dtype) not in INPUT_DTYPES:
                what = "is already fp8" if getattr(torch, dtype).itemsize == 1 else f"is {dtype}"
                raise ConnectError(
                    f"{where(t.engine_id, t.rank)}: trainer tensor {name!r} {what}; quantizer "
                    f"{self.quantizer.name!r} takes bf16, fp16 or fp32 and sends the engine its fp8 weight and scale"
                )
            try:
                scale = self.quantizer.scale_name(name)
            except QuantizerError as exc:
                raise ConnectError(f"{where(t.engine_id, t.rank)}: {exc}") from None
            if scale in sources:
                raise ConnectError(
                    f"{where(t.engine_id, t.rank)}: the trainer has a tensor {scale!r}, the name of "
                    f"{name!r}'s scale; the sender makes the scales"
                )
        return frozenset(fp8)

    def checkpoint_specs(self, sources: Mapping[str, ParamSpec]) -> dict[str, ParamSpec]:
        """The checkpoint the engine's loader is given: quantized weights in fp8, each followed by its scale."""
        out = {}
        for name, spec in sources.items():
            if name not in self.quantized:
                out[name] = spec
                continue
            out[name] = ParamSpec(name, spec.shape, str(FP8_DTYPE).removeprefix("torch."))
            scale = self.quantizer.scale_name(name)
            out[scale] = ParamSpec(scale, self.quantizer.scale_shape(spec.shape), "float32")
        return out

    def _scales_loaded(
        self, rank_model: RankModel, params: Mapping[str, torch.Tensor], checkpoint: Mapping[str, ParamSpec],
        scales: Sequence[str],
    ) -> LoaderTrace:
        """`traced_loader` of the quantized checkpoint; ConnectError naming a scale the loader refuses
        or loads into no parameter (the engine holds no scale of that name)."""
        engine = self.table.engine
        try:
            trace = traced_loader(self.table, rank_model, params, checkpoint)
        except LoaderRefusal as exc:
            if exc.tensor not in scales:
                raise
            raise self._scale_not_held(exc.tensor, f"{engine}'s loader refuses it: {exc.cause}") from exc
        loaded = {hf for hfs in trace.feeds.values() for hf in hfs}
        unloaded = [scale for scale in scales if scale not in loaded]
        if unloaded:
            more = f"; nor {len(unloaded) - 1} more scales" if len(unloaded) > 1 else ""
            raise self._scale_not_held(unloaded[0], f"{engine}'s loader loads it into no parameter{more}")
        return trace

    def _scale_not_held(self, scale: str, why: str) -> ConnectError:
        t = self.table
        return ConnectError(
            f"{where(t.engine_id, t.rank)}: the engine holds no scale {scale!r} (quantizer {self.quantizer.name!r} "
            f"names its scales `...{self.quantizer.scale_suffix}`; {why})"
        )
