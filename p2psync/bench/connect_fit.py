"""Per-structure costs fitted to the connect bench's measured points, and what they give for
models too large to compile here.

Seconds: a rank's compile (CPU seconds of its one-thread process: the machine is shared, and
its load moves wall seconds far more than CPU seconds) is fitted, non-negative least squares,
as a cost per instance and per HF input element of each structure (`archs.STRUCTURES`: the
base tensors, each decoder layer's tensors but its routed experts, each routed expert the rank
loads), counting only the instances the layout compiled, plus a cost per group it compiled by
renaming another of the same structure (its `shared_groups`; the layers those groups make up
are not counted as compiled). Points of one hidden size and vocabulary cannot tell costs per
instance from costs per element (a structure's elements are then its instances times a
constant): the fit then keeps the costs per element, which scale with a model's dimensions,
and says so. Sharing is extrapolated as measured: a larger model compiles as many layers as
the measured point with the most layers did and renames the rest; where no point shared, it
compiles every layer.
Memory: a compile's peak RSS above its start is bounded per structure by bytes per input
element of the rank's largest group of that structure (the least ratio over the points: tight
for a structure whose group set some point's peak); a larger model's largest groups come from
the group structures the points compiled (`archs.template`), mapped onto its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import archs

#: What every extrapolation assumes, printed with it.
ASSUMPTIONS = (
    "a rank's compile costs, for each structure (base, decoder layer, routed expert), the fitted seconds per "
    "compiled instance and per compiled HF input element, plus the fitted seconds per group renamed from another "
    "of the same structure (linear, as measured)",
    "layers are shared as measured: a model compiles as many decoder layers as the measured point with the most "
    "layers compiled and renames the others (as many groups per layer as there); where no point shared, every "
    "layer is compiled",
    "the trainer ranks share the compile (trainer/layouts.py splits the units over the world and exchanges "
    "them): with at least as many trainer ranks as the engine's TP ranks, each compiles at most one engine "
    "rank's layout, so a trainer rank's connect costs one rank's compile (the exchange is not measured here; "
    "one trainer rank alone would pay TP of them)",
    "peak memory: the largest, over structures, of the fitted bytes per input element of that structure's largest "
    "group (from the group structures the points compiled) times its elements",
)
#: The fitted columns: per compiled instance of each structure, per compiled element of each, per renamed group.
COLUMNS = (*(f"{s}_{per}" for per in ("instance", "element") for s in archs.STRUCTURES), "shared_group")


@dataclass(frozen=True)
class Target:
    """A model to extrapolate to: a shape on an engine layout."""

    label: str
    shape: archs.Shape
    engine: str
    tp: int
    ep: int


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Non-negative least squares (active set: the most negative coefficient's column dropped
    until none is negative; all-zero columns get 0); None when the other columns are not
    independent."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    scale = a.abs().amax(dim=0)
    keep = [j for j in range(a.shape[1]) if scale[j] > 0]
    if int(torch.linalg.matrix_rank(a[:, keep] / scale[keep])) < len(keep):
        return None
    out = [0.0] * a.shape[1]
    while keep:
        x = torch.linalg.lstsq(a[:, keep] / scale[keep], y).solution.squeeze(1) / scale[keep]
        if bool((x >= 0).all()):
            for j, v in zip(keep, x.tolist()):
                out[j] = v
            break
        keep.pop(int(x.argmin()))
    return out


@dataclass(frozen=True)
class Compiled:
    """What a rank's layout compiled: instances and elements of each structure, and groups renamed."""

    instances: Mapping[str, float]
    elements: Mapping[str, float]
    shared_groups: float

    def row(self) -> list[float]:
        return [*(self.instances[s] for s in archs.STRUCTURES), *(self.elements[s] for s in archs.STRUCTURES),
                self.shared_groups]


def _compiled(rank: Mapping[str, Any]) -> Compiled:
    """A measured rank's compiled work: its layer and expert structures but for the share of
    its layer groups compiled by renaming."""
    shared = rank["shared_groups"] or 0
    kept = 1 - shared / rank["layer_groups"] if rank["layer_groups"] else 1.0
    scale = {"base": 1.0, "layer": kept, "expert": kept}
    return Compiled({s: rank["instances"][s] * scale[s] for s in archs.STRUCTURES},
                    {s: rank["elements"][s] * scale[s] for s in archs.STRUCTURES}, shared)


def _measured(point: dict[str, Any]) -> Compiled:
    """A point's compiled work, per compiled rank."""
    ranks = [_compiled(r) for r in point["ranks"]]
    return Compiled({s: sum(r.instances[s] for r in ranks) / len(ranks) for s in archs.STRUCTURES},
                    {s: sum(r.elements[s] for r in ranks) / len(ranks) for s in archs.STRUCTURES},
                    sum(r.shared_groups for r in ranks) / len(ranks))


def _compile_seconds(point: dict[str, Any]) -> float:
    """CPU seconds of a point's compile, per compiled rank."""
    return float(point["cpu_seconds"]["compile"]) / len(point["ranks"])


def fit(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The costs of `COLUMNS`, and bytes per element of each structure's largest group, from the
    measured `points` (each `connect_point.measure`'s result); each point's fitted seconds
    beside its measured ones; or why nothing could be fitted."""
    usable = [p for p in points if "error" not in p]
    rows = [_measured(p).row() for p in usable]
    ys = [_compile_seconds(p) for p in usable]
    model, costs = "per instance and per element", nnls(rows, ys) if len(usable) >= len(COLUMNS) else None
    if costs is None:
        n = len(archs.STRUCTURES)
        model, rest = "per element", nnls([r[n:] for r in rows], ys) if len(usable) > n else None
        if rest is None:
            return {"error": "the points do not separate the structures' costs: sweep at least two layer counts and "
                             "two expert counts"}
        costs = [0.0] * n + rest
    per_element = {
        s: min((p["added_bytes"]["compile"] / r["largest_group_by_structure"][s] for p in usable for r in p["ranks"]
                if r["largest_group_by_structure"][s]), default=0.0)
        for s in archs.STRUCTURES
    }
    return {
        "model": model, "costs": dict(zip(COLUMNS, costs)), "bytes_per_group_element": per_element,
        "sharing": sharing(usable), "marginal": marginals(usable),
        "points": [
            {"name": p["name"], "compile_seconds_per_rank": y, "fitted": sum(c * x for c, x in zip(costs, row)),
             "compile_added_bytes": p["added_bytes"]["compile"], "fitted_bytes": _peak(per_element, {
                 s: max(r["largest_group_by_structure"][s] for r in p["ranks"]) for s in archs.STRUCTURES})}
            for p, row, y in zip(usable, rows, ys)
        ],
    }


def sharing(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """How the measured point with the most layers, among those whose layouts renamed groups,
    shared them: its layers, those compiled, its groups per layer; None where none renamed any."""
    shared = [(p["point"]["shape"]["layers"], p, r) for p in points for r in p["ranks"] if r["shared_groups"]]
    if not shared:
        return None
    layers, point, rank = max(shared, key=lambda item: item[0])
    counts = rank["groups_per_layer"]
    per_layer = max(set(counts), key=counts.count)  # the layers that repeat (a dense first layer has its own count)
    return {"point": point["name"], "layers": rank["instances"]["layer"],
            "compiled_layers": rank["instances"]["layer"] - rank["shared_groups"] / per_layer,
            "groups_per_layer": per_layer}


def _peak(per_element: Mapping[str, float], largest: Mapping[str, int | None]) -> float | None:
    known = [per_element[s] * n for s, n in largest.items() if n is not None]
    return max(known) if known else None


def marginals(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seconds each added decoder layer, or each added local expert per layer, cost a rank's
    compile, between measured points alike but in that: the growth itself, fit or no fit."""
    out = []
    for axis in ("layer", "expert"):
        lines: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for p in points:
            shape = p["point"]["shape"]
            lines.setdefault((shape["hidden"], shape["vocab"], shape["layers" if axis == "expert" else "experts"]),
                             []).append(p)
        for line in lines.values():
            line.sort(key=lambda p: p["ranks"][0]["instances"][axis])
            for a, b in zip(line, line[1:]):
                added = b["ranks"][0]["instances"][axis] - a["ranks"][0]["instances"][axis]
                if added > 0:
                    out.append({"axis": axis, "from": a["name"], "to": b["name"], "added": added,
                                "seconds_per_added": (_compile_seconds(b) - _compile_seconds(a)) / added})
    return out


def extrapolate(fitted: dict[str, Any], points: Sequence[dict[str, Any]], target: Target) -> dict[str, Any]:
    """The fitted costs of one rank of `target` and of a trainer rank's connect to one engine of it."""
    out: dict[str, Any] = {"label": target.label, "engine": target.engine, "tp": target.tp, "ep": target.ep}
    if "error" in fitted:
        return out | {"error": fitted["error"]}
    hf_config = archs.config(target.shape)
    specs = archs.hf_specs(hf_config)
    structures = archs.rank_structures(hf_config, specs, target.engine, target.ep)
    layers = structures["instances"]["layer"]
    shared = fitted["sharing"]
    compiled_layers = layers if shared is None else min(layers, shared["compiled_layers"])
    kept = {"base": 1.0, "layer": compiled_layers / layers, "expert": compiled_layers / layers}
    work = Compiled({s: structures["instances"][s] * kept[s] for s in archs.STRUCTURES},
                    {s: structures["elements"][s] * kept[s] for s in archs.STRUCTURES},
                    0.0 if shared is None else (layers - compiled_layers) * shared["groups_per_layer"])
    parts = [c * x for c, x in zip(fitted["costs"].values(), work.row())]
    per_rank = sum(parts)
    experts_per_rank = archs.experts_per_rank(hf_config, target.engine, target.ep)
    largest = largest_groups(points, specs, experts_per_rank)
    n = len(archs.STRUCTURES)
    return out | {
        "parameters": sum(archs.elements(specs).values()), **structures, "experts_per_rank": experts_per_rank,
        "compiled_layers": compiled_layers, "shared_groups": work.shared_groups,
        "seconds_per_engine_rank": per_rank, "seconds_per_connect": per_rank,
        "seconds_by_structure": {s: parts[i] + parts[i + n] for i, s in enumerate(archs.STRUCTURES)}
        | {"renamed": parts[-1]},
        "largest_group_by_structure": largest,
        "peak_bytes": _peak(fitted["bytes_per_group_element"], largest),
    }


def largest_groups(
    points: Sequence[dict[str, Any]], specs: Mapping[str, Any], experts_per_rank: int
) -> dict[str, int | None]:
    """Input elements of the largest group of each structure on a rank of the model of `specs`,
    from the group structures the points compiled (None where none of them maps onto it)."""
    sizes = archs.masked_sizes(specs)
    found: dict[str, list[int]] = {s: [] for s in archs.STRUCTURES}
    for p in points:
        for rank in p["ranks"]:
            for tmpl in rank["group_templates"]:
                n = archs.template_elements(tmpl, sizes, experts_per_rank / max(1, rank["experts_per_layer"]))
                if n is not None:
                    found[archs.group_structure(m.replace("#", "0") for m in tmpl)].append(n)
    return {s: max(v) if v else None for s, v in found.items()}
