"""Copy maps compile index maps into strided copies that replay them exactly (no sglang needed)."""

from __future__ import annotations

import subprocess
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.adapters.sglang.copymap import compile_copies, index_inputs, param_map, written_runs


def replay(index: torch.Tensor, specs: list[tuple[str, tuple[int, ...]]]) -> torch.Tensor:
    """Compile `index` and replay it on the index-coded inputs; -1 where nothing is copied."""
    ranges, tensors = index_inputs(specs)
    copies = compile_copies(index, ranges)
    assert copies is not None
    out = torch.full(index.shape, -1.0, dtype=torch.float64)
    for copy in copies:
        copy.apply(tensors[copy.src], out.view(-1))
    return out


def fused_rows(q: int, k: int, v: int, width: int, rank: int, tp: int) -> tuple[torch.Tensor, list]:
    """The index map of a qkv_proj shard: rows of q, k and v of TP rank `rank`, in that order."""
    specs = [("q", (q, width)), ("k", (k, width)), ("v", (v, width))]
    ranges, tensors = index_inputs(specs)
    shard = [t[rank * (t.shape[0] // tp) : (rank + 1) * (t.shape[0] // tp)] for t in tensors.values()]
    return torch.cat(shard).to(torch.int64) - 1, specs


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 8), st.sampled_from([1, 2, 4]), st.data())
@settings(max_examples=40, deadline=None)
def test_fused_row_shards_replay_exactly_in_three_copies(heads, kv_heads, width, tp, data):
    rank = data.draw(st.integers(0, tp - 1))
    index, specs = fused_rows(heads * 4, kv_heads * 4, kv_heads * 4, width, rank, tp)
    ranges, _ = index_inputs(specs)
    assert torch.equal(replay(index, specs), index.to(torch.float64) + 1)
    assert len(compile_copies(index, ranges)) == 3


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.data())
@settings(max_examples=40, deadline=None)
def test_column_shards_transposes_and_holes_replay_exactly(rows, cols, parts, data):
    specs = [("w", (rows, cols * parts))]
    ranges, tensors = index_inputs(specs)
    part = data.draw(st.integers(0, parts - 1))
    index = tensors["w"][:, part * cols : (part + 1) * cols].to(torch.int64) - 1
    if data.draw(st.booleans()):
        index = index.t().contiguous()
    holes = torch.tensor(data.draw(st.lists(st.booleans(), min_size=index.numel(), max_size=index.numel()))).view(index.shape)
    index[holes] = -1
    assert torch.equal(replay(index, specs), torch.where(index >= 0, index.to(torch.float64) + 1, -1.0))


def test_a_gather_is_not_a_copy():
    specs = [("w", (4096,))]
    ranges, tensors = index_inputs(specs)
    index = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
    assert compile_copies(index, ranges) is None


def test_param_map_keeps_zero_padding_and_refuses_computed_values():
    specs = [("w", (3, 2))]
    ranges, tensors = index_inputs(specs)
    probed = torch.cat([tensors["w"], torch.zeros(1, 2, dtype=torch.float64)])  # 3 copied rows, 1 zero row
    real = torch.cat([torch.randn(3, 2), torch.zeros(1, 2)]).to(torch.bfloat16)
    written = torch.ones(4, 2, dtype=torch.bool)
    found = param_map(probed, real, written, ranges)
    assert found is not None and len(found.copies) == 1
    assert [(start, data.tolist()) for start, data in found.constants] == [(12, [0] * 4)]
    probed[3] = 0.5  # the loader computed something: in the probe it is not what the real load wrote
    assert param_map(probed, real, written, ranges) is None


def test_written_runs():
    assert written_runs(torch.tensor([1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)) == [(0, 2), (3, 1), (6, 1)]
    assert written_runs(torch.zeros(3, dtype=torch.bool)) == []


def test_importing_p2psync_and_the_sglang_adapter_does_not_import_sglang():
    code = (
        "import sys, p2psync, p2psync.adapters.sglang, p2psync.adapters.sglang.plugin\n"
        "from p2psync.core.plugins import registry\n"
        "assert registry().engine_target('sglang').__name__ == 'SglangEngineTarget'\n"
        "assert 'sglang' not in sys.modules, 'sglang was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
