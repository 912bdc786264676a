"""The loader's trace on meta: its blocks, replayed on real tensors, write what the loader itself
writes when it runs on them (the oracle: the loader on real data); what is not a plain copy has
no blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from p2psync.core.types import ParamSpec
from p2psync.layouts.copymap import replay
from p2psync.layouts.trace import trace_loader

Load = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]

ROWS, COLS = 8, 6


def column_shard(p, hf):  # TP rank 1 of 2 of a column-parallel weight, via `narrow`
    p["w"].copy_(hf["a"].narrow(0, ROWS // 2, ROWS // 2))


def row_shard(p, hf):  # a row-parallel shard: a strided block of rows
    p["w"].copy_(hf["a"][:, COLS // 2 :])


def fused(p, hf):  # q, k, v stacked into one parameter, each half-sharded, one through `.to()` and `.contiguous()`
    p["w"][:2].copy_(hf["a"][2:4])
    p["w"][2:4].copy_(hf["b"].narrow(0, 0, 2).to(torch.float64).contiguous())
    p["w"][4:].copy_(hf["c"][::2])


def experts(p, hf):  # a fused expert parameter: one expert's gate and up per index
    for e in range(3):
        p["w13"][e, :2].copy_(hf[f"experts.{e}.gate"])
        p["w13"][e, 2:].copy_(hf[f"experts.{e}.up"])


def padded(p, hf):  # vocabulary padding the loader zeroes
    p["w"][: ROWS - 2].copy_(hf["a"][: ROWS - 2])
    p["w"][ROWS - 2 :].fill_(0)


def concatenated(p, hf):  # MLA's q_a and kv_a projections, concatenated and loaded as one
    p["w"].copy_(torch.cat([hf["b"], hf["c"][1:]], dim=0))


def through_a_copy(p, hf):  # the source copied into a fresh tensor first, then sliced
    p["w"].copy_(hf["a"].clone().view(2, ROWS // 2, COLS)[1])


def scaled(p, hf):  # Gemma's `1 + w`: not a copy
    p["w"].copy_(hf["a"][: ROWS // 2] + 1)


def transposed(p, hf):  # elementwise, but not runs: the element probe decides
    p["w"].copy_(hf["t"].t())


def carried(p, hf):  # a flat view across the rows of a packed copy: two runs, not one strided map
    p["w"][0].copy_(hf["a"][:, : COLS // 2].contiguous().view(-1)[:COLS])


def in_place(p, hf):  # the loader changes its input
    hf["a"].mul_(2)
    p["w"].copy_(hf["a"][: ROWS // 2])


def rounded_twice(p, hf):  # fp32 -> fp16 -> bf16 rounds twice: not one cast
    p["w"].copy_(hf["a"][: ROWS // 2].to(torch.float16))


INPUTS = {"a": (ROWS, COLS), "b": (4, COLS), "c": (4, COLS), "t": (COLS, ROWS // 2)} | {
    f"experts.{e}.{kind}": (2, COLS) for e in range(3) for kind in ("gate", "up")
}
HALF = {"w": (ROWS // 2, COLS)}
#: Loaders whose writes are plain copies, and the shapes of the parameters they write.
COPIES = {
    column_shard: HALF, row_shard: {"w": (ROWS, COLS // 2)}, fused: {"w": (6, COLS)}, experts: {"w13": (3, 4, COLS)},
    padded: {"w": (ROWS, COLS)}, through_a_copy: HALF, concatenated: {"w": (7, COLS)},
}
#: Writes the trace does not express: their parameters are probed element by element instead.
NOT_TRACED = [scaled, transposed, carried, in_place, rounded_twice]


def params_of(load: Load) -> dict[str, tuple[int, ...]]:
    return COPIES.get(load, HALF)


def loader(load: Load, params: dict[str, torch.Tensor]) -> Callable[[Sequence[tuple[str, torch.Tensor]]], None]:
    return lambda items: load(params, dict(items))


def traced(load: Load, dtype: torch.dtype = torch.bfloat16):
    params = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in params_of(load).items()}
    specs = [ParamSpec(name, shape, "float32") for name, shape in INPUTS.items()]
    return trace_loader(loader(load, params), params, specs)


@pytest.mark.parametrize("load", list(COPIES), ids=lambda f: f.__name__)
def test_traced_copies_replayed_write_what_the_loader_writes(load):
    trace = traced(load)
    hf = {name: torch.randn(shape) for name, shape in INPUTS.items()}
    for name, shape in params_of(load).items():
        blocks = trace.copies[name]
        assert blocks is not None, f"{load.__name__}: {name} is a plain copy"
        held = {n: torch.full(s, 7.0, dtype=torch.bfloat16) for n, s in params_of(load).items()}
        load(held, {k: v.clone() for k, v in hf.items()})
        replayed = torch.full(shape, 7.0, dtype=torch.bfloat16)
        replay(blocks, {k: v.view(-1) for k, v in hf.items()}, replayed.view(-1))
        assert torch.equal(replayed, held[name]), load.__name__
        assert all(len(b.sizes) <= 2 and b.dst_strides[-1] == 1 for b in blocks), "blocks are copymap's runs"


@pytest.mark.parametrize("load", NOT_TRACED, ids=lambda f: f.__name__)
def test_what_the_trace_cannot_express_has_no_blocks(load):
    assert traced(load).copies["w"] is None


def test_feeds_name_every_input_that_reaches_a_parameter_and_mutations_are_seen():
    assert traced(fused).feeds == {"w": {"a", "b", "c"}}
    assert traced(scaled).feeds == {"w": {"a"}}
    assert traced(in_place).mutated == {"a"}
    assert traced(column_shard).mutated == set()


def test_one_block_per_expert_input_of_a_fused_parameter():
    blocks = traced(experts).copies["w13"]
    assert blocks is not None and sorted(b.source for b in blocks) == sorted(
        f"experts.{e}.{kind}" for e in range(3) for kind in ("gate", "up")
    )
    gate2 = next(b for b in blocks if b.source == "experts.2.gate")
    assert (gate2.sizes, gate2.dst_offset, gate2.src_offset) == ((2 * COLS,), 2 * 4 * COLS, 0)

