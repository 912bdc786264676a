"""Compiled layouts as bytes (p2psync/layouts/stored.py): a layout restored from its bytes has
the compiled one's groups, slots, regions and blocks, and fills exactly what the engine's own
loader writes (oracle: the toy engines' own `load_weights`, through the conformance check); it
builds its rank model only when a parameter the loader produces is filled; bytes that are not
a layout of this format are refused."""

from __future__ import annotations

import json
import zlib

import pytest

from p2psync.adapters.torch.target import IdentityLayout
from p2psync.conformance import EngineCase
from p2psync.conformance.base import assert_layout_reproduces_the_loader, specs_of
from p2psync.core.types import ParamSpec, TargetParam, TargetTable
from p2psync.layouts import stored
from p2psync.layouts.quantized import QuantizedLayout
from tests.helpers.toy_engine import ToyTarget, engine_rank, hf_model
from tests.layouts import test_fp8_toy as fp8


def restored(layout, table, target):
    """`layout` through its bytes, and the calls of its rank model's builder."""
    built = []
    data = stored.encode(layout)
    assert data is not None
    return stored.decode(data, table, lambda: built.append(table.rank) or target.rank_model(table)), built


def check_bytes(layout, table, sources, initial, expected):
    assert_layout_reproduces_the_loader(EngineCase(table, sources, initial, expected, lambda t, s: layout))


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_a_restored_layout_fills_the_engines_own_bytes(mode):
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    engine, expected, table = engine_rank(2, 1, sources)
    target = ToyTarget(layout=mode)
    layout = target.layout(table, specs_of(sources))
    again, built = restored(layout, table, target)
    assert again.compiled_groups() == layout.compiled_groups()
    assert (again.left_alone(), again.shared_groups, again.loader_params) == (
        layout.left_alone(), layout.shared_groups, layout.loader_params
    )
    assert built == [] and again.rank_model is None, "no rank model until a loader parameter is filled"
    check_bytes(again, table, sources, {n: p.data.clone() for n, p in engine.named_parameters()}, expected)
    assert built == [1], "the norms (1 + w) need the engine's loader: its rank model is built once"


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_a_restored_fp8_layout_quantizes_and_fills_the_engines_own_bytes(mode):
    tensors = fp8.trainer_tensors()
    engine, expected, table = fp8.engine_rank(2, 1, tensors)
    target = fp8.Fp8ToyTarget(layout=mode)
    layout = target.layout(table, specs_of(tensors))
    again, built = restored(layout, table, target)
    assert isinstance(again, QuantizedLayout)
    assert (again.quantizer, again.dtype, again.quantized) == (layout.quantizer, layout.dtype, layout.quantized)
    assert again.groups() == layout.groups() and again.inner.compiled_groups() == layout.inner.compiled_groups()
    check_bytes(again, table, tensors, {n: p.data.clone() for n, p in engine.named_parameters()}, expected)
    assert built == ([] if mode == "copy_map" else [1]), "a pure copy map never builds a rank model"


def test_layouts_that_cost_less_to_build_than_to_read_are_not_kept():
    table = TargetTable(
        engine_id="t", rank=0, world_size=1, engine="torch", layout_key={}, transport="samehost", transport_info={},
        control_url="", params=(TargetParam("w", (2, 2), "float32", 0, 16),),
    )
    assert stored.encode(IdentityLayout(table, {"w": ParamSpec("w", (2, 2), "float32")})) is None


def _doc(data: bytes) -> dict:
    return json.loads(zlib.decompress(data))


def _pack(doc: dict) -> bytes:
    return zlib.compress(json.dumps(doc).encode())


def _wrong_format(data: bytes) -> bytes:
    return _pack({**_doc(data), "format": stored.FORMAT + 1})


def _string_offset(data: bytes) -> bytes:
    doc = _doc(data)
    doc["layout"]["groups"][0][3][0][1] = "0"  # a slot's offset
    return _pack(doc)


def _name_out_of_range(data: bytes) -> bytes:
    doc = _doc(data)
    doc["layout"]["groups"][0][0][0] = len(doc["layout"]["names"])
    return _pack(doc)


def _unknown_dtype(data: bytes) -> bytes:
    doc = _doc(data)
    doc["layout"]["groups"][0][3][0][3] = "load"  # torch.load is no dtype
    return _pack(doc)


@pytest.mark.parametrize(
    "damage",
    [lambda d: d[: len(d) // 2], lambda d: b"garbage", _wrong_format, _string_offset, _name_out_of_range, _unknown_dtype],
    ids=["truncated", "garbage", "format", "string-offset", "name-index", "dtype"],
)
def test_bytes_that_are_not_a_layout_are_refused(damage):
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    _, _, table = engine_rank(2, 0, sources)
    data = stored.encode(ToyTarget().layout(table, specs_of(sources)))
    assert data is not None
    with pytest.raises(stored.StoredLayoutError):
        stored.decode(damage(data), table, lambda: pytest.fail("no rank model is built for refused bytes"))
