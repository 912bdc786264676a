"""A layout read back checked against the engine's own loader (p2psync/layouts/verify.py): what
this build compiles passes (toy and fp8 toy engines, copy map and replica); a layout changed
where no loader runs in the check (an instance of a structure outside its sample, a group that
no longer reads one of its HF tensors, a block past its parameter, an fp8 layout that quantizes
another set of tensors) is refused. Session-level checks, with the engines' own bytes as the
oracle: tests/trainer/test_layout_disk.py."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable

import pytest

from p2psync.conformance.base import specs_of
from p2psync.layouts import stored
from p2psync.layouts.verify import UnverifiedLayout, verify
from tests.helpers.toy_engine import ToyTarget, engine_rank, hf_model
from tests.layouts import test_fp8_toy as fp8


def read_back(layout, table, target, change: Callable[[dict], None] = lambda layout: None):
    """`layout` through its bytes, its stored data changed by `change` first."""
    doc = json.loads(zlib.decompress(stored.encode(layout)))
    change(doc["layout"])
    return stored.decode(zlib.compress(json.dumps(doc).encode()), table, lambda: target.rank_model(table))


def toy(layers: int = 2, mode: str = "copy_map"):
    sources = {n: t.detach().clone() for n, t in hf_model(0, layers).state_dict().items()}
    _, _, table = engine_rank(2, 1, sources, layers)
    target = ToyTarget(layout=mode)
    return target.layout(table, specs_of(sources)), table, specs_of(sources), target


def param(layout: dict, name: str) -> list:
    return next(p for g in layout["groups"] for p in g[3] if layout["names"][p[0]] == name)


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_what_this_build_compiles_passes(mode):
    layout, table, specs, target = toy(mode=mode)
    verify(read_back(layout, table, target), table, specs, target)
    tensors = fp8.trainer_tensors()
    _, _, table = fp8.engine_rank(2, 1, tensors)
    target = fp8.Fp8ToyTarget(layout=mode)
    verify(read_back(target.layout(table, specs_of(tensors)), table, target), table, specs_of(tensors), target)


def _swap_layer_2(layout: dict) -> None:
    q, k = param(layout, "layers.2.qkv")[6][:2]
    q[2], k[2] = k[2], q[2]


def _drop_v(layout: dict) -> None:
    """Layer 0's qkv no longer reads v: the engine would keep its old v rows."""
    names = layout["names"]
    group = next(g for g in layout["groups"] if names[g[1][0]] == "layers.0.qkv")
    group[0] = [i for i in group[0] if names[i] != "layers.0.v.weight"]
    qkv = group[3][0]
    qkv[6] = [b for b in qkv[6] if names[b[0]] != "layers.0.v.weight"]
    qkv[5][3] = 2 * qkv[5][3] // 3  # its region: the q and k rows


def _block_past_the_end(layout: dict) -> None:
    param(layout, "layers.0.o")[6][0][2] += 1  # the o block one element on: its last past o's end


@pytest.mark.parametrize(
    "change, why",
    [
        (_swap_layer_2, "'layers.2.qkv' is not compiled as its structure's first instance"),
        (_drop_v, "no group reads HF tensor 'layers.0.v.weight', which feeds 'layers.0.qkv'"),
        (_block_past_the_end, "'layers.0.o': a block reads or writes outside its tensors"),
    ],
    ids=["unsampled-instance", "dropped-input", "block-out-of-bounds"],
)
def test_a_layout_changed_where_no_loader_runs_is_refused(change, why):
    layout, table, specs, target = toy(layers=5)
    with pytest.raises(UnverifiedLayout, match=why):
        verify(read_back(layout, table, target, change), table, specs, target)


def test_an_fp8_layout_that_quantizes_other_tensors_is_refused():
    tensors = fp8.trainer_tensors()
    _, _, table = fp8.engine_rank(2, 1, tensors)
    target = fp8.Fp8ToyTarget()
    layout = target.layout(table, specs_of(tensors))
    again = read_back(layout, table, target, lambda data: data["quantized"].append("router.weight"))  # held bf16
    with pytest.raises(UnverifiedLayout, match="quantizes 'router.weight' wrongly"):
        verify(again, table, specs_of(tensors), target)
