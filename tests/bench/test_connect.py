"""`p2psync bench --connect`: the fit recovers known costs; a point past its memory limit is
killed and reported; on a tiny Qwen3-MoE, an engine rank's offline table is what the engine's
own rank publishes, the layouts the bench compiled from it and the trainer's specs are those
LayoutCache gives, they write the bytes the engine's own loader writes, the bench reports them,
and its second compile is answered by the process's cache.

The fit tests run in tox env py; the sglang and vLLM ones in conformance-sglang and
conformance-vllm (skipped where the engine is missing)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from p2psync.bench.archs import STRUCTURES
from p2psync.bench.connect_fit import COLUMNS, fit
from p2psync.cli import main

#: The tiny model: Qwen3-30B-A3B's attention and experts, shrunk to one layer of 4 experts.
TINY = ["--arch", "Qwen3-30B-A3B", "--layers", "1", "--experts", "4", "--hidden", "64", "--vocab", "256"]


def _point(name: str, layers: int, experts: int, hidden: int, costs: dict[str, float]) -> dict[str, Any]:
    """A measured point as `connect_point.measure` reports it, its compile taking `costs` exactly:
    4 groups per layer, those of all layers but 3 renamed from others from 4 layers on."""
    shared = 4 * (layers - 3) if layers > 3 else 0
    kept = (layers - shared / 4) / layers
    instances = {"base": 1, "layer": layers, "expert": layers * experts}
    elements = {"base": 2 * 1000 * hidden, "layer": layers * 7 * hidden**2, "expert": layers * experts * 3 * hidden}
    seconds = costs["shared_group"] * shared + sum(
        (costs[f"{s}_instance"] * instances[s] + costs[f"{s}_element"] * elements[s]) * (1 if s == "base" else kept)
        for s in STRUCTURES
    )
    largest = {"base": 1000 * hidden, "layer": 4 * hidden * hidden, "expert": experts * 40 * hidden}
    return {
        "name": name, "point": {"shape": {"hidden": hidden, "vocab": 1000, "layers": layers, "experts": experts}},
        "cpu_seconds": {"compile": seconds},
        "added_bytes": {"compile": max(40 * largest["base"], 60 * largest["expert"])},
        "ranks": [{"instances": instances, "elements": elements, "largest_group_by_structure": largest,
                   "layer_groups": 4 * layers, "groups_per_layer": [4] * layers, "shared_groups": shared}],
    }


def _grid(costs: dict[str, float], hiddens: tuple[int, ...]) -> list[dict[str, Any]]:
    return [_point(f"L{n}-E{e}-H{h}", n, e, h, costs) for h in hiddens for n in (1, 2, 4, 8) for e in (8, 32)]


def test_fit_recovers_the_costs_per_instance_and_per_element_of_each_structure():
    costs = dict(zip(COLUMNS, [2.0, 0.5, 0.05, 3e-8, 1e-7, 2e-7, 0.01]))
    fitted = fit(_grid(costs, (256, 512)))
    assert fitted["model"] == "per instance and per element"
    assert fitted["costs"] == pytest.approx(costs, rel=1e-6)
    assert fitted["sharing"]["compiled_layers"] == 3 and fitted["sharing"]["groups_per_layer"] == 4
    # each structure's bytes per element of its largest group, least over the points: tight where it set the peak
    bound = {"base": 40, "layer": 40 * 1000 / (4 * 512), "expert": 60}
    assert fitted["bytes_per_group_element"] == pytest.approx(bound)
    growth = {(m["axis"], m["from"], m["to"]): m["seconds_per_added"] for m in fitted["marginal"]}
    # one more compiled layer of 8 experts at hidden 256: its instance, elements, and 8 experts'
    per_layer = 0.5 + 1e-7 * 7 * 256 * 256 + 8 * (0.05 + 2e-7 * 3 * 256)
    assert growth[("layer", "L1-E8-H256", "L2-E8-H256")] == pytest.approx(per_layer)
    assert growth[("layer", "L4-E8-H256", "L8-E8-H256")] == pytest.approx(4 * 0.01 / 1)  # 4 layers more, renamed


def test_fit_at_one_hidden_size_keeps_costs_per_element_and_says_so():
    costs = dict(zip(COLUMNS, [0.0, 0.0, 0.0, 3e-8, 1e-7, 2e-7, 0.01]))
    fitted = fit(_grid(costs, (256,)))
    assert fitted["model"] == "per element"
    assert fitted["costs"] == pytest.approx(costs, rel=1e-6, abs=1e-12)
    assert "error" in fit(_grid(costs, (256,))[:1])  # one point separates nothing


@pytest.mark.parametrize("argv", [
    ["--connect"],  # torch engines compile no layouts
    ["--connect", "--engine", "vllm", "--engine-ep", "2"],  # vLLM layouts are tensor parallel only
    ["--connect", "--engine", "sglang", "--arch", "Qwen3-30B-A3B", "--engine-tp", "4", "--engine-ep", "3"],
    ["--connect", "--engine", "sglang", "--ways", "p2p"],  # an option of the update bench
    ["--layers", "2"],  # an option of --connect
])
def test_options_the_connect_bench_cannot_run_are_refused(argv, capsys):
    assert main(["bench", *argv]) == 2
    assert capsys.readouterr().err.strip()


def test_a_point_past_its_memory_limit_is_killed_and_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    """Each point runs in a process of its own, watched: past --max-rss-gb it is killed, the run
    goes on and fails; --save keeps the result apart from the update bench's (a connect/ folder)."""
    argv = ["bench", "--connect", "--engine", "sglang", *TINY, "--max-rss-gb", "0.001", "--json"]
    assert main([*argv, "--save", str(tmp_path)]) == 1
    (point,) = json.loads(capsys.readouterr().out)["points"]
    assert point["error"].startswith("killed: resident memory")
    assert len(list((tmp_path / "connect").glob("*-sglang-connect-Qwen3-30B-A3B.json"))) == 1


def _measure(engine: str) -> Any:
    """The connect bench's measurement of TINY on rank 0 of TP 2, in this process."""
    from p2psync.bench.archs import Shape
    from p2psync.bench.connect_point import Point, measure

    shape = Shape("Qwen3-30B-A3B", layers=1, experts=4, hidden=64, vocab=256)
    measured = measure(Point(engine, shape, tp=2, ep=2 if engine == "sglang" else 1, ranks=(0,)))
    assert measured.result["second_compile_cached"]
    assert measured.result["seconds"]["second_compile"] < measured.result["seconds"]["compile"]
    return measured


def _tiny() -> tuple[dict[str, Any], dict[str, Any]]:
    """TINY's HF config, and random float32 tensors under the names transformers' save_pretrained
    gives its model (the checkpoint's names: the oracle of the bench's specs)."""
    from tests.helpers.sglang_models import hf_tensors
    from transformers import AutoConfig

    from p2psync.bench import archs

    config = archs.config(archs.Shape("Qwen3-30B-A3B", layers=1, experts=4, hidden=64, vocab=256))
    return config, hf_tensors(AutoConfig.for_model(**config))


def _check(
    measured: Any, config: dict[str, Any], real: Any, held: Mapping[str, Any], tensors: Mapping[str, Any],
    local_experts: int,
) -> None:
    """The bench's offline table is the engine's own `real` one (addresses aside), its specs the
    checkpoint's; the layouts it compiled are those LayoutCache gives for them, they write the
    bytes the engine's own loader wrote into `held` (prefilled with SGLANG_FILL), and the bench
    reported them."""
    import torch
    from tests.helpers.sglang_models import produce

    from p2psync.bench import archs
    from p2psync.core.plugins import registry
    from p2psync.core.types import numel
    from p2psync.trainer.layouts import LayoutCache

    specs, (table,), (layout,) = measured.specs, measured.tables, measured.layouts
    assert {n: s.shape for n, s in specs.items()} == {n: tuple(t.shape) for n, t in tensors.items()}
    assert (_key(table), table.world_size) == (_key(real), real.world_size)
    assert [(p.name, p.shape, p.dtype, p.nbytes) for p in table.params] == \
        [(p.name, p.shape, p.dtype, p.nbytes) for p in real.params]
    assert list(LayoutCache(registry(), {}).layouts([table], specs).values()) == [layout]
    written = produce(layout, tensors, table)
    for name, t in held.items():
        assert torch.equal(written[name], t.contiguous().view(-1).view(torch.uint8)), name
    (reported,) = measured.result["ranks"]
    groups = layout.groups()
    inputs = {n for g in groups for n in g.inputs}
    assert reported["groups"] == len(groups)
    assert reported["elements"] == archs.elements(specs, inputs)
    assert reported["largest_group_elements"] == max(sum(numel(specs[n].shape) for n in g.inputs) for g in groups)
    assert reported["instances"] == {"base": 1, "layer": 1, "expert": local_experts}
    # what the extrapolation models a rank to load is what this rank's layout reads
    modelled = measured.result["modelled"]
    assert (modelled["instances"], modelled["elements"]) == (reported["instances"], reported["elements"])


def _key(table: Any) -> dict[str, Any]:
    """A table's layout key but for where the engine read its config from (sglang: a temporary
    folder of each build) and the hash that covers it."""
    key = {k: v for k, v in table.layout_key.items() if k != "config_sha256"}
    if "config" in key:
        key["config"] = {k: v for k, v in key["config"].items() if k != "_name_or_path"}
    return key


def test_connect_bench_on_sglang_ranks_compiles_their_own_layouts():
    pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed")
    from tests.helpers.sglang_models import sglang_rank

    measured = _measure("sglang")
    config, tensors = _tiny()
    held, real = sglang_rank(config, 2, 2, 0, tensors)
    _check(measured, config, real, held, tensors, local_experts=2)  # 4 experts over EP 2


def test_connect_bench_on_vllm_ranks_compiles_their_own_layouts():
    pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed")
    from p2psync.adapters.vllm import shim
    from p2psync.adapters.vllm.key import layout_key
    from p2psync.engine.endpoint import offline_table
    from p2psync.worlds.oracles import SGLANG_FILL, vllm_loaded

    measured = _measure("vllm")
    config, tensors = _tiny()
    engine = shim.engine_config(config, tp=2, dtype="bfloat16")
    model = vllm_loaded(engine, 0, tensors, fill=SGLANG_FILL)
    held = {n: p.data for n, p in model.named_parameters()}
    real = offline_table("vllm", "vllm-0", 0, 2, held, layout_key(engine, model))
    _check(measured, config, real, held, tensors, local_experts=4)  # TP only: a share of every expert on every rank
