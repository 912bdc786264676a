"""The copy-map compiler: element maps of typical shards compile into few blocks that replay
them exactly, and a permutation is refused (no engine needed)."""

from __future__ import annotations

import subprocess
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.layouts.copymap import CONSTANT, COPY, UNTOUCHED, compile_blocks, read_box, replay, written_runs


def element_map(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kind/source/value of a parameter whose element i copies input element index[i] (-1: untouched)."""
    flat = index.reshape(-1)
    kind = torch.where(flat >= 0, COPY, UNTOUCHED).to(torch.int8)
    return kind, flat.clone(), torch.zeros(flat.shape, dtype=torch.float64)


def replayed(index: torch.Tensor, inputs: list[tuple[str, int]], sizes: dict[str, int]) -> tuple[torch.Tensor, int]:
    """Replay the compiled blocks on index-coded inputs: each element becomes the index it copied."""
    blocks = compile_blocks(*element_map(index), inputs)
    assert blocks is not None
    sources = {name: torch.arange(start, start + sizes[name], dtype=torch.float64) for name, start in inputs}
    out = torch.full((index.numel(),), -1.0, dtype=torch.float64)
    replay(blocks, sources, out)
    return out.view(index.shape), len(blocks)


def fused_rows(q: int, k: int, v: int, width: int, rank: int, tp: int) -> tuple[torch.Tensor, list, dict]:
    """The index map of a qkv_proj shard: rows of q, k and v of TP rank `rank`, in that order."""
    inputs, sizes, parts, start = [], {}, [], 0
    for name, rows in (("q", q), ("k", k), ("v", v)):
        codes = torch.arange(start, start + rows * width).view(rows, width)
        parts.append(codes[rank * (rows // tp) : (rank + 1) * (rows // tp)])
        inputs.append((name, start))
        sizes[name] = rows * width
        start += rows * width
    return torch.cat(parts), inputs, sizes


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 8), st.sampled_from([1, 2, 4]), st.data())
@settings(max_examples=40, deadline=None)
def test_fused_row_shards_replay_exactly_in_three_blocks(heads, kv_heads, width, tp, data):
    rank = data.draw(st.integers(0, tp - 1))
    index, inputs, sizes = fused_rows(heads * 4, kv_heads * 4, kv_heads * 4, width, rank, tp)
    out, count = replayed(index, inputs, sizes)
    assert torch.equal(out, index.to(torch.float64))
    assert count == 3


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.data())
@settings(max_examples=40, deadline=None)
def test_column_shards_transposes_and_holes_replay_exactly(rows, cols, parts, data):
    codes = torch.arange(rows * cols * parts).view(rows, cols * parts)
    part = data.draw(st.integers(0, parts - 1))
    index = codes[:, part * cols : (part + 1) * cols].clone()
    if data.draw(st.booleans()):
        index = index.t().contiguous()
    holes = torch.tensor(data.draw(st.lists(st.booleans(), min_size=index.numel(), max_size=index.numel()))).view(index.shape)
    index[holes] = -1
    out, _ = replayed(index, [("w", 0)], {"w": rows * cols * parts})
    assert torch.equal(out, index.to(torch.float64))


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.data())
@settings(max_examples=60, deadline=None)
def test_the_read_box_of_a_shard_is_the_rows_and_columns_it_reads(rows, cols, row_parts, col_parts, data):
    """A rank reading one (row part, column part) tile of a matrix, as row- and column-split TP
    shards do: the box of its blocks is that tile exactly (the oracle: the tile's own slice)."""
    height, width = rows * row_parts, cols * col_parts
    codes = torch.arange(height * width).view(height, width)
    r, c = data.draw(st.integers(0, row_parts - 1)), data.draw(st.integers(0, col_parts - 1))
    index = codes[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols].clone()
    if data.draw(st.booleans()):  # the parameter may hold the tile transposed: the same elements are read
        index = index.t().contiguous()
    blocks = compile_blocks(*element_map(index), [("w", 0)])
    assert blocks is not None
    assert read_box(blocks, height, width) == (r * rows, (r + 1) * rows, c * cols, (c + 1) * cols)


def test_the_read_box_of_blocks_that_wrap_rows_takes_those_rows_whole():
    """Elements 3..8 of a 3 x 4 matrix run across a row end: rows 0-2, every column."""
    index = torch.arange(3, 9)
    blocks = compile_blocks(*element_map(index), [("w", 0)])
    assert blocks is not None and read_box(blocks, 3, 4) == (0, 3, 0, 4)
    assert read_box([], 3, 4) == (3, 0, 4, 0)  # nothing read: an empty box


def test_a_column_split_weight_is_one_block():
    codes = torch.arange(8 * 12).view(8, 12)
    out, count = replayed(codes[:, 4:8].contiguous(), [("w", 0)], {"w": 96})
    assert count == 1 and torch.equal(out, codes[:, 4:8].to(torch.float64))


def test_a_permutation_is_not_a_copy():
    index = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
    assert compile_blocks(*element_map(index), [("w", 0)]) is None


def test_constants_are_filled_and_untouched_elements_left_alone():
    kind = torch.tensor([COPY, COPY, CONSTANT, CONSTANT, UNTOUCHED], dtype=torch.int8)
    source = torch.tensor([2, 3, -1, -1, -1])
    value = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    blocks = compile_blocks(kind, source, value, [("w", 0)])
    out = torch.full((5,), 7.0, dtype=torch.bfloat16)
    replay(blocks, {"w": torch.tensor([10.0, 11.0, 12.0, 13.0])}, out)
    assert out.tolist() == [12.0, 13.0, 0.0, 0.0, 7.0]


def test_written_runs():
    assert written_runs(torch.tensor([1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)) == [(0, 2), (3, 1), (6, 1)]
    assert written_runs(torch.zeros(3, dtype=torch.bool)) == []


def test_importing_p2psync_and_the_engine_adapters_imports_no_engine():
    code = (
        "import sys, p2psync, p2psync.adapters.sglang, p2psync.adapters.sglang.plugin, p2psync.adapters.vllm.plugin\n"
        "from p2psync.core.plugins import registry\n"
        "assert registry().engine_target('sglang').__name__ == 'SglangEngineTarget'\n"
        "assert registry().engine_target('vllm').__name__ == 'VllmEngineTarget'\n"
        "assert 'sglang' not in sys.modules and 'vllm' not in sys.modules, 'an engine was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
