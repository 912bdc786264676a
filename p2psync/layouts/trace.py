"""Tracing an engine's loader on meta: which HF tensors feed which parameters, and, where the
loader only moves data, the strided copies it makes, at a cost in operations, not elements.

The loader runs once on meta tensors (shapes, strides and storage offsets, no data) under a
dispatch mode that keeps, per storage, what its elements are:

- an HF tensor's storage, and every storage an elementwise copy made of a view of one
  (`clone`, `.to()`, `.contiguous()`), holds copies of that tensor's elements at affine
  positions (`_Copied`): any view of it is again affine where no index carries across a
  dimension of the storage's layout;
- a storage made by `zeros` / `full` holds one constant;
- anything else computed from HF data is opaque.

A `copy_` into a parameter's storage then is a strided block: the destination view's sizes,
strides and offset (exact on meta) and the source's affine map. A parameter written in any way
this cannot express (arithmetic, a gather, an opaque source, a cast that rounds twice) has no
traced copies, and the layout probes its elements instead. Tracing is only ever a proposal:
`layout.EngineLayout` checks it against the real loader on random inputs before using it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.types import ParamSpec
from .copymap import Block
from .probe import Loader
from .structures import in_layer, layer_of, renamed

_aten = torch.ops.aten
#: Ops whose result holds its (first) argument's elements, in its shape, perhaps in another dtype.
_ELEMENTWISE_COPIES = frozenset({_aten.clone.default, _aten._to_copy.default, _aten.lift_fresh_copy.default})
#: Ops that make a tensor of one constant, and that constant.
_CONSTANTS = {
    _aten.zeros.default: 0.0, _aten.zeros_like.default: 0.0, _aten.new_zeros.default: 0.0,
    _aten.ones.default: 1.0, _aten.ones_like.default: 1.0, _aten.new_ones.default: 1.0,
}
#: Ops that make a tensor of the constant they are given: its position among their arguments.
_FILLED = {_aten.full.default: 1, _aten.full_like.default: 1, _aten.new_full.default: 2}
#: Above this many blocks for one write, the write is a gather, not a strided copy.
_MAX_BLOCKS_PER_WRITE = 4096


@dataclass(frozen=True)
class _Digit:
    """One dimension of the tensor that made a storage: `size` indices, `stride` apart in the
    storage, `source_stride` apart in the HF tensor."""

    size: int
    stride: int
    source_stride: int


@dataclass(frozen=True)
class _Copied:
    """A storage whose element at `base + sum(i_d * digit_d.stride)` is element
    `source_base + sum(i_d * digit_d.source_stride)` of HF tensor `source`; `digits` nest
    (largest stride first, the last stride 1). `dtypes`: every dtype its values passed
    through, the HF tensor's first."""

    source: str
    itemsize: int
    base: int
    digits: tuple[_Digit, ...]
    source_base: int
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class _Constant:
    value: float


@dataclass(frozen=True)
class _Pieces:
    """A storage `torch.cat` made along its outermost dimension: `_Copied` pieces, each over
    the storage range [start, end) (fused q_a / kv_a projections of MLA)."""

    pieces: tuple[tuple[int, int, _Copied], ...]


_OPAQUE = object()


@dataclass
class LoaderTrace:
    """What one meta run of a loader did: `feeds` (per parameter, the HF tensors whose data
    reached it), `copies` (per parameter fed, its writes as strided blocks in the order the
    loader made them; None where a write is not a plain copy or constant) and `mutated` (HF
    tensors the loader changed in place, which a real run must therefore be given copies of)."""

    feeds: dict[str, set[str]] = field(default_factory=dict)
    copies: dict[str, list[Block] | None] = field(default_factory=dict)
    mutated: set[str] = field(default_factory=set)

    def layer_part(self, layer: int, to: int, names: Collection[str]) -> LoaderTrace | None:
        """The part of this trace of layer `layer`'s parameters, every name moved to layer `to`;
        None where a moved name is not in `names` or a parameter is fed from another layer."""
        out = LoaderTrace()
        for param, hfs in self.feeds.items():
            if any(layer_of(hf) != layer_of(param) for hf in hfs):
                return None
            if layer_of(param) != layer:
                continue
            moved = {name: in_layer(name, to) for name in (param, *hfs)}
            if any(name not in names for name in moved.values()):
                return None
            blocks = self.copies.get(param)
            out.feeds[moved[param]] = {moved[hf] for hf in hfs}
            out.copies[moved[param]] = None if blocks is None else [renamed(b, moved, ("source",)) for b in blocks]
        out.mutated = {in_layer(name, to) for name in self.mutated if layer_of(name) == layer}
        return out

    @staticmethod
    def merged(traces: Sequence[LoaderTrace]) -> LoaderTrace:
        out = LoaderTrace()
        for t in traces:
            out.feeds.update(t.feeds)
            out.copies.update(t.copies)
            out.mutated |= t.mutated
        return out


def trace_loader(load: Loader, params: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec]) -> LoaderTrace:
    """Run `load` once on meta stand-ins of `specs` into `params` (on meta)."""
    inputs = {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in specs}
    mode = _Tracer(inputs, params)
    with mode:
        load(list(inputs.items()))
    trace = LoaderTrace(dict(mode.writes), {}, mode.mutated)
    for name in trace.feeds:
        trace.copies[name] = None if name in mode.poisoned else mode.blocks.get(name, [])
    return trace


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Tracer(TorchDispatchMode):
    def __init__(self, inputs: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.sources: dict[int, set[str]] = {_key(t): {name} for name, t in inputs.items()}
        self.maps: dict[int, object] = {
            _key(t): _Copied(name, t.element_size(), 0, (_Digit(max(1, t.numel()), 1, 1),), 0, (t.dtype,))
            for name, t in inputs.items()
        }
        self.input_of = {_key(t): name for name, t in inputs.items()}
        self.params = {_key(t): (name, t) for name, t in params.items()}
        self.writes: dict[str, set[str]] = defaultdict(set)
        self.blocks: dict[str, list[Block]] = defaultdict(list)
        self.poisoned: set[str] = set()
        self.mutated: set[str] = set()
        self._alive: list[Any] = []  # storages stay alive so that their ids are never reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        came_from = set().union(*(self.sources.get(_key(t), ()) for t in flat_in))
        for t in _mutated(func, args, kwargs):
            self._written(func, args, t, came_from)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if _key(t) in self.params:
                if came_from:
                    self.writes[self.params[_key(t)][0]] |= came_from
            else:
                self._made(func, args, kwargs, t, came_from)
        return out

    def _written(self, func: Any, args: tuple, t: torch.Tensor, came_from: set[str]) -> None:
        key = _key(t)
        if key in self.params:
            name, param = self.params[key]
            if came_from:
                self.writes[name] |= came_from
            blocks = self._param_write(func, args, t, param)
            if blocks is None:
                self.poisoned.add(name)
            else:
                self.blocks[name] += blocks
            return
        if key in self.input_of:
            self.mutated.add(self.input_of[key])
        if came_from or key in self.maps:  # no longer a plain copy or constant
            self.sources.setdefault(key, set()).update(came_from)
            self.maps[key] = _OPAQUE
            self._alive.append(t.untyped_storage())

    def _made(self, func: Any, args: tuple, kwargs: dict, t: torch.Tensor, came_from: set[str]) -> None:
        key = _key(t)
        if key in self.sources or key in self.maps:
            return  # a view of a storage already followed
        if came_from:
            self.sources[key] = set(came_from)
        if func in _CONSTANTS or func in _FILLED:
            value = _CONSTANTS[func] if func in _CONSTANTS else kwargs.get("fill_value", args[_FILLED[func]])
            self.maps[key] = _Constant(float(value)) if isinstance(value, (int, float)) else _OPAQUE
        elif func in _ELEMENTWISE_COPIES and _key(args[0]) in self.maps:
            self.maps[key] = self._copy_of(args[0], t)
        elif func is _aten.cat.default:
            self.maps[key] = self._cat_of(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0), t)
        elif came_from:
            self.maps[key] = _OPAQUE
        else:
            return
        self._alive.append(t.untyped_storage())

    def _copy_of(self, src: torch.Tensor, t: torch.Tensor) -> object:
        """The map of storage `t`, an elementwise copy of `src`."""
        m = self.maps.get(_key(src), _OPAQUE)
        if isinstance(m, _Constant):
            return m
        if not isinstance(m, _Copied) or tuple(t.shape) != tuple(src.shape):
            return _OPAQUE
        affine = _affine(m, src)
        digits = _dense_digits(tuple(t.shape), tuple(t.stride()), affine[1]) if affine is not None else None
        if affine is None or digits is None:
            return _OPAQUE
        return _Copied(m.source, t.element_size(), int(t.storage_offset()), digits, affine[0], _through(m, t.dtype))

    def _cat_of(self, parts: Sequence[torch.Tensor], dim: int, t: torch.Tensor) -> object:
        """The map of storage `t`, `torch.cat(parts, dim)`: pieces where `dim` is the outermost
        dimension of more than one index (each part then a contiguous range of `t`)."""
        dim %= max(1, t.dim())
        if any(n != 1 for n in t.shape[:dim]):
            return _OPAQUE
        pieces, start = [], int(t.storage_offset())
        for part in parts:
            m = self.maps.get(_key(part), _OPAQUE)
            if part.numel() == 0:
                continue
            if not isinstance(m, _Copied) or part.dim() != t.dim():
                return _OPAQUE
            affine = _affine(m, part)
            digits = _dense_digits(tuple(part.shape), _contiguous(tuple(part.shape)), affine[1]) if affine else None
            if affine is None or digits is None:
                return _OPAQUE
            piece = _Copied(m.source, t.element_size(), start, digits, affine[0], _through(m, t.dtype))
            pieces.append((start, start + part.numel(), piece))
            start += part.numel()
        if tuple(t.stride()) != _contiguous(tuple(t.shape)):
            return _OPAQUE
        return _Pieces(tuple(pieces))

    def _param_write(self, func: Any, args: tuple, dst: torch.Tensor, param: torch.Tensor) -> list[Block] | None:
        """The blocks of one write into a parameter's view `dst`; None where it is not a copy."""
        if dst.element_size() != param.element_size():
            return None
        if func is _aten.zero_.default:
            return _constant_blocks(dst, 0.0)
        if func is _aten.fill_.Scalar:
            return _constant_blocks(dst, float(args[1]))
        if func is not _aten.copy_.default:
            return None
        src = args[1]
        m = self.maps.get(_key(src), _OPAQUE)
        if isinstance(m, _Constant):
            return _constant_blocks(dst, m.value)
        view = _View.of(src)
        parts: list[tuple[_Copied, _View]] | None
        if isinstance(m, _Pieces) and tuple(src.shape) == tuple(dst.shape):
            parts = _split(m, view)
            targets = _rows_of(dst, [part.sizes[0] for _, part in parts or ()])
        elif isinstance(m, _Copied):
            parts, targets = [(m, view)], [(int(dst.storage_offset()), tuple(dst.shape))]
        else:
            return None
        if parts is None:
            return None
        blocks = []
        for (piece, part), (offset, sizes) in zip(parts, targets):
            if not _same_as_direct((*piece.dtypes, param.dtype)):
                return None
            affine = _affine(piece, part)
            src_strides = _broadcast(part.sizes, affine[1], sizes) if affine is not None else None
            if affine is None or src_strides is None:
                return None
            more = _copy_blocks(piece.source, sizes, offset, dst.stride(), affine[0], src_strides)
            if more is None:
                return None
            blocks += more
        return blocks


def _digits_of(x: int, digits: Sequence[_Digit]) -> list[int] | None:
    """`x` (a storage distance) in the mixed radix of `digits`."""
    if x < 0:
        return None
    out = []
    for d in digits:
        q, x = divmod(x, d.stride)
        out.append(q)
    return out if x == 0 else None


@dataclass(frozen=True)
class _View:
    """A tensor's view of its storage, in elements."""

    itemsize: int
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> _View:
        return _View(t.element_size(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))

    @property
    def numel(self) -> int:
        n = 1
        for size in self.sizes:
            n *= size
        return n


def _split(m: _Pieces, view: _View) -> list[tuple[_Copied, _View]] | None:
    """`view` cut along its outermost dimension into the parts that each lie in one piece of `m`."""
    if not view.sizes:
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(view.sizes[1:], view.strides[1:]))
    out: list[tuple[_Copied, _View]] = []
    first, current = 0, None
    for row in range(view.sizes[0] + 1):
        start = view.offset + row * view.strides[0]
        piece = next((p for lo, hi, p in m.pieces if lo <= start and start + extent <= hi), None) if row < view.sizes[0] else None
        if row < view.sizes[0] and piece is None:
            return None
        if piece is not current or row == view.sizes[0]:
            if current is not None:
                rows = (row - first, *view.sizes[1:])
                out.append((current, _View(view.itemsize, view.offset + first * view.strides[0], rows, view.strides)))
            first, current = row, piece
    return out


def _rows_of(dst: torch.Tensor, counts: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """(storage offset, sizes) of consecutive row ranges of `dst`, `counts` rows each."""
    out, row = [], 0
    for n in counts:
        out.append((int(dst.storage_offset()) + row * dst.stride()[0] if dst.dim() else int(dst.storage_offset()),
                    (n, *dst.shape[1:]) if dst.dim() else ()))
        row += n
    return out


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _affine(m: _Copied, t: torch.Tensor | _View) -> tuple[int, tuple[int, ...]] | None:
    """(source offset, source stride per dimension) of view `t` of storage `m`, or None where
    its indices carry across a digit (not one strided map of the source)."""
    view = t if isinstance(t, _View) else _View.of(t)
    if view.itemsize != m.itemsize:
        return None
    reach = _digits_of(view.offset - m.base, m.digits)
    if reach is None:
        return None
    offset = m.source_base + sum(q * d.source_stride for q, d in zip(reach, m.digits))
    strides = []
    for n, s in zip(view.sizes, view.strides):
        if n <= 1:
            strides.append(0)
            continue
        step = _digits_of(s, m.digits)
        if step is None:
            return None
        reach = [r + (n - 1) * q for r, q in zip(reach, step)]
        strides.append(sum(q * d.source_stride for q, d in zip(step, m.digits)))
    if view.numel and any(r >= d.size for r, d in zip(reach, m.digits)):
        return None
    return offset, tuple(strides)


def _dense_digits(
    sizes: Sequence[int], strides: Sequence[int], source_strides: Sequence[int]
) -> tuple[_Digit, ...] | None:
    """The digits of a fresh storage made by a tensor of `sizes` and `strides` (each index's
    source stride given), if it covers the storage densely with no overlap (a permutation of a
    contiguous layout)."""
    dims = sorted(((n, s, src) for n, s, src in zip(sizes, strides, source_strides) if n > 1), key=lambda d: -d[1])
    expect = 1
    for n, s, _ in reversed(dims):
        if s != expect:
            return None
        expect *= n
    return tuple(_Digit(n, s, src) for n, s, src in dims) or (_Digit(1, 1, 0),)


def _broadcast(shape: tuple[int, ...], strides: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...] | None:
    """`strides` of a tensor of `shape` expanded to `to`, as `copy_` broadcasts its source."""
    if len(shape) > len(to):
        return None
    lead = len(to) - len(shape)
    out = [0] * lead
    for n, s, m in zip(shape, strides, to[lead:]):
        if n != m and n != 1:
            return None
        out.append(s if n == m else 0)
    return tuple(out)


def _coalesced(sizes: Sequence[int], *strides: Sequence[int]) -> list[tuple[int, ...]]:
    """(size, stride, stride, ...) per dimension, size-1 dimensions dropped and neighbours merged
    where every side continues across them."""
    dims = [(n, *s) for n, *s in zip(sizes, *strides) if n != 1]
    out: list[tuple[int, ...]] = []
    for dim in dims:
        if out and all(prev == dim[0] * cur for prev, cur in zip(out[-1][1:], dim[1:])):
            out[-1] = (out[-1][0] * dim[0], *dim[1:])
        else:
            out.append(dim)
    return out


def _copy_blocks(
    source: str, sizes: tuple[int, ...], dst_offset: int, dst_strides: Sequence[int], src_offset: int,
    src_strides: Sequence[int],
) -> list[Block] | None:
    """A strided copy as `copymap` blocks: runs contiguous on both sides, in rows of a constant
    step (2-D at most, as `copymap.compile_blocks` makes them); None where the innermost
    dimension is not contiguous on both sides (a transpose, a broadcast)."""
    if 0 in sizes:
        return []
    dims = _coalesced(sizes, dst_strides, src_strides) or [(1, 1, 1)]
    n, d, s = dims[-1]
    if (d, s) != (1, 1):
        return None
    if len(dims) == 1:
        return [Block(source, (n,), dst_offset, (1,), src_offset, (1,))]
    rows, step_d, step_s = dims[-2]
    outer = dims[:-2]
    count = 1
    for size, *_ in outer:
        count *= size
    if count > _MAX_BLOCKS_PER_WRITE:
        return None
    blocks = []
    for index in range(count):
        d_off, s_off, rest = dst_offset, src_offset, index
        for size, od, os in reversed(outer):
            rest, i = divmod(rest, size)
            d_off, s_off = d_off + i * od, s_off + i * os
        blocks.append(Block(source, (rows, n), d_off, (step_d, 1), s_off, (step_s, 1)))
    return blocks


def _constant_blocks(dst: torch.Tensor, value: float) -> list[Block] | None:
    """A constant written into view `dst`, as 1-D runs (how `copymap` writes constants)."""
    if dst.numel() == 0:
        return []
    dims = _coalesced(tuple(dst.shape), dst.stride()) or [(1, 1)]
    n, d = dims[-1]
    if d != 1:
        return None
    starts = [int(dst.storage_offset())]
    for size, stride in reversed(dims[:-1]):
        starts = [s + i * stride for i in range(size) for s in starts]
        if len(starts) > _MAX_BLOCKS_PER_WRITE:
            return None
    return [Block(None, (n,), start, (1,), value=value) for start in sorted(starts)]


def _through(m: _Copied, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes `m`'s values passed through, once copied into `dtype`."""
    return m.dtypes if dtype == m.dtypes[-1] else (*m.dtypes, dtype)


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of `narrow` is a value of `wide`."""
    if wide == narrow:
        return True
    widening = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
                torch.float32: (torch.float64,)}
    return wide in widening.get(narrow, ())


def _same_as_direct(chain: Sequence[torch.dtype]) -> bool:
    """Casting through `chain` (source dtype first, the parameter's last) gives what one cast
    from the first to the last gives: every step exact, but for one rounding into the last,
    after which every dtype holds the last's values."""
    last, rounded = chain[-1], False
    for a, b in zip(chain, chain[1:]):
        if rounded:
            if not _holds(b, last):
                return False
        elif not _holds(b, a):
            if b != last:
                return False
            rounded = True
    return True


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an aten op writes into."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out
