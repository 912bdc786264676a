"""Copy maps: a loader's effect on one parameter as a short list of strided copies.

A probe fills each HF tensor of a group with the index of each of its elements
(float64 holds them exactly), lets the loader write into float64 stand-ins of
the parameters, and reads back, for every parameter element, which input
element landed there. `compile_copies` turns that index map into
boxes where the index is affine in the position: each box is one
`dst.as_strided(...).copy_(src.as_strided(...))`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: Above this many copies per element a parameter is a gather, not a strided copy.
MAX_COPIES_PER_ELEMENT = 1 / 64


@dataclass(frozen=True)
class Copy:
    """`dst[dst_offset + i . dst_stride] = src[src_offset + i . src_stride]` for every i < size (flat views)."""

    src: str
    src_offset: int
    src_stride: tuple[int, ...]
    dst_offset: int
    dst_stride: tuple[int, ...]
    size: tuple[int, ...]

    def apply(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`src` is the contiguous HF tensor, `dst` the contiguous parameter view."""
        d = dst.as_strided(self.size, self.dst_stride, dst.storage_offset() + self.dst_offset)
        d.copy_(src.as_strided(self.size, self.src_stride, src.storage_offset() + self.src_offset))


@dataclass(frozen=True)
class InputRange:
    """Where one HF tensor's element indices start in a probe."""

    name: str
    start: int
    numel: int


def index_inputs(specs: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[list[InputRange], dict[str, torch.Tensor]]:
    """Probe inputs: each HF tensor holds its elements' global indices plus one (zero is
    what loaders fill padding with), as float64."""
    ranges, tensors, start = [], {}, 0
    for name, shape in specs:
        n = 1
        for d in shape:
            n *= d
        ranges.append(InputRange(name, start, n))
        tensors[name] = torch.arange(start + 1, start + n + 1, dtype=torch.float64).view(shape)
        start += n
    return ranges, tensors


@dataclass(frozen=True)
class ParamMap:
    """What a loader writes into one parameter: strided copies of inputs, and constant
    bytes (such as the zeros it writes into vocabulary padding)."""

    copies: tuple[Copy, ...]
    constants: tuple[tuple[int, torch.Tensor], ...]

    def apply(self, sources: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None:
        """Write into `dst` (the contiguous parameter view) from contiguous HF tensors."""
        flat = dst.view(-1)
        for copy in self.copies:
            copy.apply(sources[copy.src], flat)
        raw = flat.view(torch.uint8)
        for start, data in self.constants:
            raw[start : start + data.numel()] = data


def param_map(
    probed: torch.Tensor, reference: torch.Tensor, written: torch.Tensor, ranges: Sequence[InputRange]
) -> ParamMap | None:
    """The map of one parameter, or None where its bytes are not copies and constants.

    `probed` is the float64 stand-in after the index probe; `reference` the
    parameter after a real load and `written` the elements that load wrote.
    Written elements that hold no input index must hold, in the probe, the value
    the real load gave them: only then are they constant.
    """
    total = ranges[-1].start + ranges[-1].numel if ranges else 0
    from_input = (probed == probed.round()) & (probed >= 1) & (probed <= total) & written
    constant = written & ~from_input
    if not torch.equal(probed[constant], reference[constant].to(torch.float64)):
        return None
    copies = compile_copies(torch.where(from_input, probed - 1, -1.0).to(torch.int64), ranges)
    if copies is None:
        return None
    size = reference.element_size()
    raw = reference.reshape(-1).view(torch.uint8)
    constants = tuple(
        (start * size, raw[start * size : (start + n) * size].clone()) for start, n in written_runs(constant)
    )
    return ParamMap(tuple(copies), constants)


def compile_copies(index: torch.Tensor, ranges: Sequence[InputRange]) -> list[Copy] | None:
    """Strided copies reproducing `index` (-1: not from an input), or None if it takes
    too many to be a copy."""
    starts = torch.tensor([r.start for r in ranges], dtype=torch.int64)
    budget = max(16, int(index.numel() * MAX_COPIES_PER_ELEMENT))
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]] = []
    if not _boxes(index, 0, _contiguous_strides(index.shape), starts, boxes, budget):
        return None
    copies = []
    for dst_offset, size, dst_stride, src_base, src_stride in boxes:
        source = ranges[int(torch.searchsorted(starts, torch.tensor(src_base), right=True)) - 1]
        copies.append(Copy(source.name, src_base - source.start, src_stride, dst_offset, dst_stride, size))
    return copies


def written_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a flat boolean mask."""
    flat = mask.reshape(-1).to(torch.int8)
    edges = torch.diff(flat, prepend=flat.new_zeros(1), append=flat.new_zeros(1))
    begins = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [(b, e - b) for b, e in zip(begins, ends)]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def _boxes(
    index: torch.Tensor,
    dst_offset: int,
    dst_stride: tuple[int, ...],
    starts: torch.Tensor,
    out: list,
    budget: int,
) -> bool:
    """Append boxes covering the written part of `index`; False once over budget.

    Consecutive slices along the first dimension that are each affine, with the
    same inner strides, the same input and a constant step, merge into one box;
    other slices recurse one dimension down.
    """
    if index.dim() == 0:
        value = int(index)
        if value >= 0:
            out.append((dst_offset, (), (), value, ()))
        return len(out) <= budget
    n, inner = index.shape[0], tuple(index.shape[1:])
    rows = index.reshape(n, -1)
    base = rows[:, 0]
    strides = []
    for k, size in enumerate(inner):
        if size > 1:
            unit = (slice(None),) + tuple(1 if j == k else 0 for j in range(len(inner)))
            strides.append(index[unit] - base)
        else:
            strides.append(torch.zeros_like(base))
    s = torch.stack(strides, 1) if inner else base.new_zeros(n, 0)
    grid = torch.stack(torch.meshgrid(*[torch.arange(d) for d in inner], indexing="ij"), -1).reshape(-1, len(inner)) if inner else base.new_zeros(1, 0)
    predicted = base[:, None] + s @ grid.T
    low, high = rows.min(1).values, rows.max(1).values
    source = torch.searchsorted(starts, low, right=True)
    affine = (rows == predicted).all(1) & (low >= 0) & (s >= 0).all(1) & (source == torch.searchsorted(starts, high, right=True))
    empty = high < 0
    affine_l, empty_l, base_l, src_l = affine.tolist(), empty.tolist(), base.tolist(), source.tolist()
    s_l = [tuple(x) for x in s.tolist()]
    r = 0
    while r < n:
        if empty_l[r]:
            r += 1
            continue
        if not affine_l[r]:
            if not _boxes(index[r], dst_offset + r * dst_stride[0], dst_stride[1:], starts, out, budget):
                return False
            r += 1
            continue
        end, step = r + 1, 0
        if end < n and affine_l[end] and s_l[end] == s_l[r] and src_l[end] == src_l[r] and base_l[end] >= base_l[r]:
            step = base_l[end] - base_l[r]
            while end < n and affine_l[end] and s_l[end] == s_l[r] and src_l[end] == src_l[r] and base_l[end] - base_l[end - 1] == step:
                end += 1
        out.append((dst_offset + r * dst_stride[0], (end - r, *inner), dst_stride, base_l[r], (step, *s_l[r])))
        if len(out) > budget:
            return False
        r = end
    return True
