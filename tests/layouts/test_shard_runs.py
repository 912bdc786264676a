"""`block_runs` against an element-by-element oracle: every element of a copy map's blocks
whose source lies in the held ranges, and no other, lands where the block sends it; also
with one held range per row, as a row-split (Megatron row-parallel) shard holds them."""

from __future__ import annotations

import random

from p2psync.layouts.copymap import Block
from p2psync.layouts.shard import block_runs


def element_pairs(blocks: list[Block], held: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """(destination, source) of every held element the blocks copy, one element at a time."""
    pairs = set()
    for b in blocks:
        if b.source is None:
            continue
        sizes = b.sizes if len(b.sizes) == 2 else (1, b.sizes[0])
        dst_strides = b.dst_strides if len(b.sizes) == 2 else (0, 1)
        src_strides = b.src_strides if len(b.sizes) == 2 else (0, 1)
        for r in range(sizes[0]):
            for c in range(sizes[1]):
                src = b.src_offset + r * src_strides[0] + c * src_strides[1]
                if any(start <= src < end for start, end in held):
                    pairs.add((b.dst_offset + r * dst_strides[0] + c * dst_strides[1], src))
    return pairs


def run_pairs(blocks: list[Block], held: list[tuple[int, int]]) -> set[tuple[int, int]]:
    runs = block_runs("p", blocks, {"x": held})
    assert all(r.numel > 0 for r in runs), runs
    return {(r.param_offset + i, r.source_offset + i) for r in runs for i in range(r.numel)}


def test_runs_copy_exactly_the_held_elements() -> None:
    rng = random.Random(0)
    for _ in range(200):
        total = rng.randint(1, 300)
        cuts = sorted(rng.sample(range(total + 1), min(total + 1, rng.randint(0, 10))))
        held = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        rows, n = rng.randint(1, 6), rng.randint(1, 8)
        step = rng.randint(n, n + 8)
        blocks = [Block(None, (2,), 0, (1,))]
        if (rows - 1) * step + n <= total:
            offset = rng.randint(0, total - (rows - 1) * step - n)
            blocks.append(Block("x", (rows, n), 2, (n + rng.randint(0, 3), 1), offset, (step, 1)))
        blocks.append(Block("x", (min(total, 5),), 200, (1,), 0, (1,)))
        assert run_pairs(blocks, held) == element_pairs(blocks, held), (blocks, held)


def test_a_row_split_shard_gives_one_run_per_row() -> None:
    """A [64, 32] tensor whose columns 8-24 of every row this rank holds, into an engine rank
    holding columns 0-16 (a transposed TP split): per row, columns 8-16."""
    rows, cols = 64, 32
    held = [(r * cols + 8, r * cols + 24) for r in range(rows)]
    blocks = [Block("x", (rows, 16), 0, (16, 1), 0, (cols, 1))]
    runs = block_runs("p", blocks, {"x": held})
    want = [(r * 16 + 8, r * cols + 8, 8) for r in range(rows)]
    assert [(r.param_offset, r.source_offset, r.numel) for r in runs] == want
    assert run_pairs(blocks, held) == element_pairs(blocks, held)
