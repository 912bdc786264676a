"""One configuration of the connect bench, measured in this process: a model shape, an engine
kind and parallel layout, the engine ranks to compile.

Phases, each timed and its peak RSS taken above this process's baseline (RSS once the engine
library is imported) and above the phase's start (`rss.reset_peak` before each phase):
- `specs`: the trainer's HF tensors (names, shapes; transformers on meta). Not part of connect.
- `tables`: each engine rank's table made as its endpoint publishes it, on meta, by the
  adapter's `meta_table` (stands in for reading the tables from the rendezvous; engine side).
- `rank_model`: the trainer's rebuild of each rank's model from its layout key alone (the
  engine target's `rank_model`), on meta, as compiling a layout starts with.
- `compile`: the layouts, through `LayoutCache.layouts` as a Session's connect builds them
  (its own rank models included).
- `second_compile`: the same tables through a second `LayoutCache` (a second Session of this
  process): the process-wide layout cache answers.

`python -m p2psync.bench.connect_point POINT_JSON OUT_JSON` measures one point in a process
of its own (`connect.run_connect_bench` starts one per point: `ru_maxrss` and the process-wide
layout cache only grow), on one thread.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from . import archs, rss
from ..core.types import numel

if TYPE_CHECKING:
    from ..core.layout import Layout
    from ..core.types import ParamSpec, TargetTable

#: The engine kinds whose layouts the connect bench compiles.
ENGINES = ("sglang", "vllm")
PHASES = ("specs", "tables", "rank_model", "compile", "second_compile")


@dataclass(frozen=True)
class Point:
    """One measured configuration: `shape` on `engine` ranks of TP `tp` (experts over `ep`:
    sglang only), compiling the layouts of engine ranks `ranks`."""

    engine: str
    shape: archs.Shape
    tp: int
    ep: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"the connect bench compiles {', '.join(ENGINES)} layouts, not {self.engine!r}")
        if self.engine == "vllm" and self.ep != 1:
            raise ValueError("vLLM layouts are tensor parallel only: expert parallelism (ep) must be 1")
        if self.tp < 1 or self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide tp ({self.tp})")
        if not self.ranks or any(not 0 <= r < self.tp for r in self.ranks):
            raise ValueError(f"engine ranks {self.ranks} outside 0..{self.tp - 1}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Point:
        return cls(**{**data, "shape": archs.Shape(**data["shape"]), "ranks": tuple(data["ranks"])})


@dataclass
class Measured:
    """What measuring a point found: the JSON-ready result, and the objects it compiled."""

    result: dict[str, Any]
    tables: list[TargetTable] = field(default_factory=list)
    specs: dict[str, ParamSpec] = field(default_factory=dict)
    layouts: list[Layout] = field(default_factory=list)


class _Phases:
    """Seconds of each phase (wall and this process's CPU), its peak RSS above the process's
    baseline and above its own start."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.added_bytes: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = rss.reset_peak()
        start, cpu = time.monotonic(), time.process_time()
        yield
        self.seconds[name] = time.monotonic() - start
        self.cpu_seconds[name] = time.process_time() - cpu
        self.peak_bytes[name] = max(0, rss.peak() - self.baseline)
        self.added_bytes[name] = max(0, rss.peak() - before)


def _tables(point: Point, hf_config: dict[str, Any]) -> list[TargetTable]:
    """The tables of the point's engine ranks, made on meta by the engine's adapter."""
    if point.engine == "sglang":
        from ..adapters.sglang import meta_table as sglang_table

        return [sglang_table(hf_config, tp=point.tp, ep=point.ep, rank=rank) for rank in point.ranks]
    from ..adapters.vllm import meta_table as vllm_table

    return [vllm_table(hf_config, tp=point.tp, rank=rank) for rank in point.ranks]


def _import_engine(engine: str) -> str:
    """Import the engine library (its import is no phase); its version."""
    if engine == "sglang":
        from ..adapters.sglang import version
    else:
        from ..adapters.vllm import version
    return version()


def measure(point: Point) -> Measured:
    """Measure `point` in this process (see the module's docstring); layouts stay cached here."""
    from ..core.plugins import registry
    from ..layouts import RankModelTarget
    from ..trainer.layouts import LayoutCache

    engine_version = _import_engine(point.engine)
    rss.return_freed_memory()
    phases = _Phases(rss.reset_peak())
    with phases.phase("specs"):
        hf_config = archs.config(point.shape)
        specs = archs.hf_specs(hf_config)
    with phases.phase("tables"):
        tables = _tables(point, hf_config)
    first = LayoutCache(registry(), {})
    target = first.target(tables[0])
    if not isinstance(target, RankModelTarget):
        raise ValueError(f"{point.engine} engine targets do not build rank models")
    with phases.phase("rank_model"):
        for table in tables:
            target.rank_model(table)
    with phases.phase("compile"):
        layouts = list(first.layouts(tables, specs).values())
    with phases.phase("second_compile"):
        again = list(LayoutCache(registry(), {}).layouts(tables, specs).values())
    result = {
        "point": point.to_json(), "name": f"{point.engine}-tp{point.tp}-ep{point.ep}-{point.shape.name}",
        "engine_version": engine_version, "seconds": phases.seconds, "peak_bytes": phases.peak_bytes,
        "cpu_seconds": phases.cpu_seconds, "added_bytes": phases.added_bytes,
        "baseline_bytes": phases.baseline, "second_compile_cached": all(a is b for a, b in zip(again, layouts)),
        "parameters": sum(numel(s.shape) for s in specs.values()),
        "config": {k: hf_config.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
        | {"experts": archs.experts(hf_config)},
        "ranks": [_rank(table, layout, specs) for table, layout in zip(tables, layouts)],
        "modelled": {
            **archs.rank_structures(hf_config, specs, point.engine, point.ep),
            "experts_per_rank": archs.experts_per_rank(hf_config, point.engine, point.ep),
        },
    }
    return Measured(result, tables, specs, layouts)


def _rank(table: TargetTable, layout: Layout, specs: dict[str, ParamSpec]) -> dict[str, Any]:
    """One engine rank's layout: its groups, those of decoder layers (and per layer), how many
    were compiled by renaming another (the layout's `shared_groups`, where it has them), the instances and
    elements of each structure among its HF inputs, its largest group's elements (of all, and
    of each structure), its local experts, and its groups' structures (`archs.template`)."""
    groups = layout.groups()
    inputs = {name for g in groups for name in g.inputs}
    experts = {e for e in map(archs.expert_of, inputs) if e is not None}
    templates = {json.dumps(archs.template(g.inputs), sort_keys=True) for g in groups}
    sizes = [(archs.group_structure(g.inputs), sum(numel(specs[n].shape) for n in g.inputs)) for g in groups]
    return {
        "rank": table.rank, "parameters": sum(numel(p.shape) for p in table.params), "bytes": table.nbytes,
        "groups": len(groups), "layer_groups": sum(kind != "base" for kind, _ in sizes),
        "groups_per_layer": sorted(Counter(n for n in map(archs.layer_of, groups) if n is not None).values()),
        "shared_groups": getattr(layout, "shared_groups", None),
        "instances": archs.instances(inputs), "elements": archs.elements(specs, inputs),
        "largest_group_elements": max((n for _, n in sizes), default=0),
        "largest_group_by_structure": {s: max((n for kind, n in sizes if kind == s), default=0)
                                       for s in archs.STRUCTURES},
        "experts_per_layer": len(experts) // max(1, len({layer for layer, _ in experts})),
        "group_templates": [json.loads(t) for t in sorted(templates)],
    }


def main(argv: list[str]) -> int:
    """Measure the point of JSON file argv[0] on one thread (its CPU seconds are then the work
    done, whatever else the machine runs); write its result as JSON to argv[1]."""
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    point = Point.from_json(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(measure(point).result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
