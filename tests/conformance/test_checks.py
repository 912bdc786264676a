"""The suite's own checks fail where they must (environment py): a layout that writes one wrong
byte, or only some of a parameter's bytes, fails the layout test; an engine rank holding one
wrong byte fails the round trip test. The real layout passes both."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from p2psync.adapters.torch.target import IdentityLayout
from p2psync.conformance.base import EngineCase, as_bytes, assert_engines_hold, assert_layout_reproduces_the_loader
from p2psync.core.types import ParamSpec, Region, TargetParam, TargetTable


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))


class OneWrongByte(IdentityLayout):
    """The torch layout, but the fourth byte of parameter 1.bias is flipped."""

    def fill(self, group, tensors, out):  # noqa: ANN001, ANN201
        regions = super().fill(group, tensors, out)
        if group.outputs == ("1.bias",):
            out[3] ^= 0xFF
        return regions


class FirstByteOnly(IdentityLayout):
    """The torch layout, but it says it wrote only each parameter's first byte (which is right)."""

    def fill(self, group, tensors, out):  # noqa: ANN001, ANN201
        return [Region(r.param, r.param_offset, r.buffer_offset, 1) for r in super().fill(group, tensors, out)]


def torch_case(layout: type[IdentityLayout]) -> EngineCase:
    engine = small_model(1).to(torch.bfloat16)
    sources = dict(small_model(2).state_dict())
    table = TargetTable(
        engine_id="e", rank=0, world_size=1, engine="torch", layout_key={}, transport="mooncake", transport_info={},
        control_url="", job_id="j",
        params=tuple(TargetParam(n, tuple(p.shape), "bfloat16", 0, p.numel() * 2) for n, p in engine.named_parameters()),
    )
    initial = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.load_state_dict(sources)

    def build(table: TargetTable, specs: Mapping[str, ParamSpec]) -> IdentityLayout:
        return layout(table, specs)

    return EngineCase(table, sources, initial, dict(engine.named_parameters()), build)


def test_the_torch_layout_passes():
    assert_layout_reproduces_the_loader(torch_case(IdentityLayout))


def test_a_layout_writing_one_wrong_byte_fails_the_layout_test():
    with pytest.raises(AssertionError, match=r"e rank 0 parameter '1.bias': 1 of 48 bytes differ .* at byte 3"):
        assert_layout_reproduces_the_loader(torch_case(OneWrongByte))


def test_a_layout_writing_one_right_byte_per_parameter_fails_the_layout_test():
    with pytest.raises(AssertionError, match=r"parameter '0.weight': \d+ of 1024 bytes differ"):
        assert_layout_reproduces_the_loader(torch_case(FirstByteOnly))


def test_an_engine_rank_holding_one_wrong_byte_fails_the_round_trip_test():
    expected = {n: p.detach() for n, p in small_model(3).named_parameters()}
    held = {n: t.clone() for n, t in expected.items()}
    assert_engines_hold({"engine-1[0]": (expected, held)})
    as_bytes(held["2.weight"])[7] ^= 1
    with pytest.raises(AssertionError, match=r"engine-1\[0\] parameter '2.weight': bytes differ"):
        assert_engines_hold({"engine-0[0]": (expected, expected), "engine-1[0]": (expected, held)})
