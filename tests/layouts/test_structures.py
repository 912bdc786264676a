"""Compile once per structure (`layouts.structures`): the toy engine's decoder layers are one
structure, so a deep model's layout probes three of them and renames the rest; its bytes on
every rank still equal the engine's own loader's, and a loader that treats one layer
differently is compiled layer by layer instead."""

from __future__ import annotations

import pytest
import torch

from p2psync.conformance.base import specs_of
from p2psync.layouts import RankModel
from p2psync.layouts.layout import EngineLayout, traced_loader
from p2psync.layouts.structures import layer_of
from p2psync.layouts.trace import trace_loader
from tests.helpers.toy_engine import HEAD_DIM, HEADS, ToyEngineModel, ToyRankModel, ToyTarget, engine_rank, hf_model

LAYERS = 8


class LastLayerDiffers(ToyEngineModel):
    """A loader that reads its last layer's `o` columns as if it were rank 0: a layer whose
    names and shapes match the others but whose bytes do not."""

    def load_weights(self, items):
        last = f"layers.{len(self.layers) - 1}.o.weight"
        rest = [(n, w) for n, w in items if n != last]
        super().load_weights(rest)
        rows = HEADS // self.tp * HEAD_DIM
        for name, w in items:
            if name == last:
                self.layers[-1].o.data.copy_(w[:, :rows])


def own_bytes(layout, table, sources, expected):
    """Every parameter filled by the layout, compared with the engine's own load."""
    held = {p.name: torch.full((p.nbytes,), 0xA5, dtype=torch.uint8) for p in table.params}
    for group in layout.groups():
        out = torch.zeros(group.nbytes, dtype=torch.uint8)
        for r in layout.fill(group, sources, out):
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = out[r.buffer_offset : r.buffer_offset + r.nbytes]
    for name, data in held.items():
        assert torch.equal(data, expected[name].reshape(-1).view(torch.uint8)), f"{name}: differs from the loader's"


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_a_deep_models_layers_are_compiled_once_and_renamed(tp, rank):
    sources = {n: t.detach().clone() for n, t in hf_model(0, LAYERS).state_dict().items()}
    _, expected, table = engine_rank(tp, rank, sources, LAYERS)
    layout = ToyTarget().layout(table, specs_of(sources))
    assert isinstance(layout, EngineLayout)
    # per layer: the fused qkv, o and the norm are three structures; three layers of each are probed
    assert layout.shared_groups == 3 * (LAYERS - 3)
    own_bytes(layout, table, sources, expected)


def test_a_layer_its_loader_treats_differently_is_not_shared():
    sources = {n: t.detach().clone() for n, t in hf_model(0, LAYERS).state_dict().items()}
    _, expected, table = engine_rank(2, 1, sources, LAYERS, LastLayerDiffers)

    class Quirky(ToyTarget):
        def rank_model(self, table) -> RankModel:
            return ToyRankModel(2, table.rank, layers=LAYERS, model=LastLayerDiffers)

    layout = Quirky().layout(table, specs_of(sources))
    assert layout.shared_groups == 2 * (LAYERS - 3), "o's structure is compiled layer by layer"
    own_bytes(layout, table, sources, expected)


class Counting(ToyRankModel):
    """A toy rank model that notes the layers each meta load is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: list[set[int | None]] = []

    def load(self, items) -> None:
        if items and items[0][1].is_meta:
            self.loaded.append({layer_of(name) for name, _ in items})
        super().load(items)


@pytest.mark.parametrize("model", [ToyEngineModel, LastLayerDiffers], ids=["same", "last-differs"])
def test_the_loader_is_traced_on_three_layers_of_a_structure_and_equals_the_whole_trace(model):
    sources = {n: t.detach().clone() for n, t in hf_model(0, LAYERS).state_dict().items()}
    _, _, table = engine_rank(2, 1, sources, LAYERS, model)
    rank_model = Counting(2, 1, layers=LAYERS, model=model)
    params = dict(rank_model.model.named_parameters())
    shared = traced_loader(table, rank_model, params, specs_of(sources))
    whole = trace_loader(rank_model.load, params, list(specs_of(sources).values()))  # the oracle: every layer traced
    assert (shared.feeds, shared.copies, shared.mutated) == (whole.feeds, whole.copies, whole.mutated)
    first = rank_model.loaded[0] - {None}
    if model is ToyEngineModel:
        assert first == {0, 1, LAYERS - 1}, "three layers traced, the rest renamed"
    else:
        assert first == {0, 1, LAYERS - 1} and rank_model.loaded[1] - {None} == set(range(LAYERS)), (
            "the last layer differs: every layer is traced"
        )
