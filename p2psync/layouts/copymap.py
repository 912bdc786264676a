"""Copy maps: where each element of an engine parameter comes from, compressed into strided
copies, and their replay.

A parameter's copied elements become 1-D runs (destination and source both advance by
one, same input); runs of equal length with a constant step on both sides become one
2-D block: a TP shard of a row-split weight is one block, a column-split one is one block
of `rows` runs. Constants the loader writes (zeroed padding) become fills the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: Kinds of parameter elements after a probe (see `probe.ElementMap`).
UNTOUCHED, COPY, CONSTANT, OTHER = 0, 1, 2, 3
#: Above this many blocks per element a parameter is a gather, not a strided copy: the
#: loader replays it faster than its copies would.
MAX_BLOCKS_PER_ELEMENT = 1 / 64


@dataclass(frozen=True)
class Block:
    """`dst.as_strided(sizes, dst_strides, dst_offset)` gets input `source`'s
    `as_strided(sizes, src_strides, src_offset)`, or `value` where `source` is None.
    Offsets and strides count elements of the flattened tensors."""

    source: str | None
    sizes: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    src_offset: int = 0
    src_strides: tuple[int, ...] = ()
    value: float = 0.0


def written_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a boolean mask, flattened."""
    flat = mask.reshape(-1).to(torch.int8)
    edges = torch.diff(flat, prepend=flat.new_zeros(1), append=flat.new_zeros(1))
    begins = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [(b, e - b) for b, e in zip(begins, ends)]


def compile_blocks(
    kind: torch.Tensor, source: torch.Tensor, value: torch.Tensor, inputs: Sequence[tuple[str, int]]
) -> list[Block] | None:
    """Blocks writing every COPY and CONSTANT element of a parameter (flat `kind`; `source`: the
    copied input element's code; `value`: the constant), or None where that takes too many
    blocks. `inputs` are (name, first code) in code order."""
    names = [name for name, _ in inputs]
    starts = torch.tensor([start for _, start in inputs], dtype=torch.int64)
    budget = max(16, int(kind.numel() * MAX_BLOCKS_PER_ELEMENT))
    blocks: list[Block] = []

    copied = (kind == COPY).nonzero().squeeze(1)
    codes = source[copied]
    which = torch.searchsorted(starts, codes, right=True) - 1
    for (d, s, n, k), rows, step_d, step_s in _merge(_runs(copied, codes - starts[which], which)):
        sizes, dst_strides, src_strides = ((rows, n), (step_d, 1), (step_s, 1)) if rows > 1 else ((n,), (1,), (1,))
        blocks.append(Block(names[k], sizes, d, dst_strides, s, src_strides))
        if len(blocks) > budget:
            return None

    constant = (kind == CONSTANT).nonzero().squeeze(1)
    bits = value[constant].view(torch.int64)
    for d, _, n, key in _runs(constant, constant, bits):
        blocks.append(Block(None, (n,), d, (1,), value=float(torch.tensor(key).view(torch.float64))))
        if len(blocks) > budget:
            return None
    return blocks


def replay(blocks: Sequence[Block], sources: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None:
    """Write `blocks` into the flat parameter view `dst` from flat contiguous HF tensors
    (casting to `dst`'s dtype as the engine's `copy_` does)."""
    for b in blocks:
        target = torch.as_strided(dst, b.sizes, b.dst_strides, dst.storage_offset() + b.dst_offset)
        if b.source is None:
            target.fill_(b.value)
            continue
        src = sources[b.source]
        target.copy_(torch.as_strided(src, b.sizes, b.src_strides, src.storage_offset() + b.src_offset))


def read_box(blocks: Sequence[Block], rows: int, cols: int) -> tuple[int, int, int, int]:
    """(first row, end row, first column, end column) of a box holding every element `blocks`
    read from a row-major matrix of `rows` x `cols`: a block whose runs all start in the same
    column covers those columns of its rows, any other block its rows whole."""
    r0, r1, c0, c1 = rows, 0, cols, 0
    for b in blocks:
        last = b.src_offset + sum((size - 1) * stride for size, stride in zip(b.sizes, b.src_strides))
        r0, r1 = min(r0, b.src_offset // cols), max(r1, last // cols + 1)
        column, run = b.src_offset % cols, b.sizes[-1]
        if b.src_strides[-1] == 1 and all(s % cols == 0 for s in b.src_strides[:-1]) and column + run <= cols:
            c0, c1 = min(c0, column), max(c1, column + run)
        else:
            c0, c1 = 0, cols
    return r0, r1, c0, c1


def _runs(dst: torch.Tensor, src: torch.Tensor, key: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(dst start, src start, length, key) of maximal runs where dst and src advance by one
    and key stays the same."""
    if dst.numel() == 0:
        return []
    new = torch.ones(dst.numel(), dtype=torch.bool)
    new[1:] = (dst[1:] != dst[:-1] + 1) | (src[1:] != src[:-1] + 1) | (key[1:] != key[:-1])
    first = new.nonzero().squeeze(1)
    length = torch.diff(first, append=torch.tensor([dst.numel()]))
    return list(zip(dst[first].tolist(), src[first].tolist(), length.tolist(), key[first].tolist()))


def _merge(runs: list[tuple[int, int, int, int]]) -> list[tuple[tuple[int, int, int, int], int, int, int]]:
    """Greedy merge of consecutive runs of equal length and input with constant steps:
    (first run, how many runs, dst step, src step)."""
    out = []
    i = 0
    while i < len(runs):
        d, s, n, k = runs[i]
        j = i
        if i + 1 < len(runs) and runs[i + 1][2] == n and runs[i + 1][3] == k and runs[i + 1][1] >= s:
            step_d, step_s = runs[i + 1][0] - d, runs[i + 1][1] - s  # as_strided takes no negative strides
            j = i + 1
            while (
                j + 1 < len(runs)
                and runs[j + 1][2] == n
                and runs[j + 1][3] == k
                and runs[j + 1][0] - runs[j][0] == step_d
                and runs[j + 1][1] - runs[j][1] == step_s
            ):
                j += 1
            out.append((runs[i], j - i + 1, step_d, step_s))
        else:
            out.append((runs[i], 1, 0, 0))
        i = j + 1
    return out
