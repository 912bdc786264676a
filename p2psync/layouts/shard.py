"""Copy maps restricted to a trainer rank's local shard: which of a parameter's copies read
elements this rank holds, as runs, so that every rank writes its own part without a gather."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..core.layout import CopyRun
from .copymap import Block


def block_runs(param: str, blocks: Sequence[Block], held: Mapping[str, Sequence[tuple[int, int]]]) -> list[CopyRun]:
    """The copies of `param`'s `blocks` whose source elements lie in `held` (per HF tensor,
    flat element ranges [start, end), disjoint), clipped to them, merged where both sides
    continue. Vectorized over a block's rows and the held ranges: a row-split shard holds one
    range per row, thousands per tensor."""
    dst_parts, src_parts, len_parts, names = [], [], [], []
    spans = {name: torch.tensor(sorted(ranges), dtype=torch.int64).reshape(-1, 2) for name, ranges in held.items()}
    for b in blocks:
        if b.source is None or b.source not in spans:
            continue
        rows, n = (b.sizes[0], b.sizes[1]) if len(b.sizes) == 2 else (1, b.sizes[0])
        step_d, step_s = (b.dst_strides[0], b.src_strides[0]) if len(b.sizes) == 2 else (0, 0)
        index = torch.arange(rows, dtype=torch.int64)
        src = b.src_offset + index * step_s
        dst = b.dst_offset + index * step_d
        starts, ends = spans[b.source][:, 0].contiguous(), spans[b.source][:, 1].contiguous()
        first = torch.searchsorted(ends, src, right=True)  # the first range ending after a row starts
        last = torch.searchsorted(starts, src + n)  # past the last range starting before it ends
        counts = (last - first).clamp(min=0)
        if not int(counts.sum()):
            continue
        row = torch.repeat_interleave(torch.arange(rows), counts)
        span = first[row] + torch.arange(len(row)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        lo = torch.maximum(src[row], starts[span])
        hi = torch.minimum(src[row] + n, ends[span])
        dst_parts.append(dst[row] + (lo - src[row]))
        src_parts.append(lo)
        len_parts.append(hi - lo)
        names += [b.source] * len(row)
    if not dst_parts:
        return []
    dst, src, length = torch.cat(dst_parts), torch.cat(src_parts), torch.cat(len_parts)
    order = torch.argsort(dst, stable=True)
    return _merged(param, dst[order].tolist(), src[order].tolist(), length[order].tolist(), [names[i] for i in order.tolist()])


def _merged(param: str, dst: list[int], src: list[int], length: list[int], names: list[str]) -> list[CopyRun]:
    out: list[CopyRun] = []
    for d, s, n, name in zip(dst, src, length, names):
        last = out[-1] if out else None
        if last is not None and last.source == name and last.param_offset + last.numel == d and last.source_offset + last.numel == s:
            out[-1] = CopyRun(param, last.param_offset, name, last.source_offset, last.numel + n)
        else:
            out.append(CopyRun(param, d, name, s, n))
    return out
