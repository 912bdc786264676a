"""Per-structure costs fitted to the connect bench's measured points, and what they give for
models too large to compile here.

Seconds: a rank's compile (CPU seconds of its one-thread process: the machine is shared, and
its load moves wall seconds, not CPU seconds) is fitted as, for each structure (`archs.STRUCTURES`: the base
tensors, each decoder layer's tensors but its routed experts, each routed expert the rank
loads), a cost per instance and a cost per HF input element; non-negative least squares over
the points. Points of one hidden size and vocabulary cannot tell the two apart (a structure's
elements are then its instances times a constant): the fit then keeps the per-element costs
alone, which scale with the model's dimensions, and says so. A compile that probes every
element fits costs per element; one that compiles each structure once fits costs near zero
for the repeated ones, and the extrapolation follows.
Memory: a compile's peak RSS above its start is fitted as bytes per input element of the
rank's largest parameter group plus a constant; a larger model's largest group is found by
mapping every group structure the points compiled (`archs.template`) onto its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import archs

#: What every extrapolation assumes, printed with it.
ASSUMPTIONS = (
    "a rank's compile costs, for each structure (base, decoder layer, routed expert), the fitted seconds per "
    "instance and per HF input element times the rank's instances and elements of it (linear, as measured)",
    "every trainer rank compiles every engine rank's layout of its group (today's connect): a trainer rank's "
    "connect is the sum over the engine's TP ranks, each costing what the measured ranks cost",
    "peak memory: the fitted bytes per input element of the rank's largest group (from the group structures the "
    "points compiled) plus the fitted constant",
)
#: The fitted columns: per instance of each structure, then per element of each.
COLUMNS = tuple(f"{s}_{per}" for per in ("instance", "element") for s in archs.STRUCTURES)


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
    until none is negative); None when the columns are not independent."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    scale = a.abs().amax(dim=0).clamp(min=1e-300)
    if int(torch.linalg.matrix_rank(a / scale)) < a.shape[1]:
        return None
    keep = list(range(a.shape[1]))
    out = [0.0] * a.shape[1]
    while keep:
        x = torch.linalg.lstsq(a[:, keep] / scale[keep], y).solution.squeeze(1) / scale[keep]
        if bool((x >= 0).all()):
            for j, v in zip(keep, x.tolist()):
                out[j] = v
            break
        keep.pop(int(x.argmin()))
    return out


def _row(structures: Mapping[str, Mapping[str, float]]) -> list[float]:
    return [float(structures[per][s]) for per in ("instances", "elements") for s in archs.STRUCTURES]


def _compile_seconds(point: dict[str, Any]) -> float:
    """CPU seconds of a point's compile, per compiled rank."""
    return float(point["cpu_seconds"]["compile"]) / len(point["ranks"])


def _measured(point: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A point's instances and HF input elements of each structure, per compiled rank."""
    ranks = point["ranks"]
    return {per: {s: sum(r[per][s] for r in ranks) / len(ranks) for s in archs.STRUCTURES}
            for per in ("instances", "elements")}


def fit(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Costs per instance and per element of each structure, and bytes per element of the
    largest group plus a constant, from the measured `points` (each `connect_point.measure`'s
    result); each point's fitted values beside its measured ones; or why nothing was fitted."""
    usable = [p for p in points if "error" not in p]
    rows = [_row(_measured(p)) for p in usable]
    ys = [_compile_seconds(p) for p in usable]
    model, costs = "per instance and per element", nnls(rows, ys) if len(usable) >= len(COLUMNS) else None
    if costs is None:
        half = len(archs.STRUCTURES)
        model, per_element = "per element", nnls([r[half:] for r in rows], ys) if len(usable) >= half else None
        if per_element is None:
            return {"error": "the points do not separate the structures' costs: sweep at least two layer counts and "
                             "two expert counts"}
        costs = [0.0] * half + per_element
    groups = [max(r["largest_group_elements"] for r in p["ranks"]) for p in usable]
    peaks = [float(p["added_bytes"]["compile"]) for p in usable]
    memory = nnls([[g, 1.0] for g in groups], peaks) if len(set(groups)) > 1 else None
    if memory is None:  # one size of group: the ratio alone
        memory = [max(peaks) / max(groups), 0.0]
    return {
        "model": model, "costs": dict(zip(COLUMNS, costs)), "marginal": marginals(usable),
        "bytes_per_group_element": memory[0], "bytes_constant": memory[1],
        "points": [
            {"name": p["name"], "compile_seconds_per_rank": y, "fitted": sum(c * x for c, x in zip(costs, row)),
             "compile_added_bytes": peak, "fitted_bytes": memory[0] * g + memory[1]}
            for p, row, y, g, peak in zip(usable, rows, ys, groups, peaks)
        ],
    }


def marginals(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seconds each added decoder layer, or each added local expert per layer, cost a rank's
    compile, between measured points alike but in that: the growth itself, fit or no fit."""
    usable = sorted((p for p in points if "error" not in p), key=lambda p: p["name"])
    out = []
    for axis, other in (("layer", "expert"), ("expert", "layer")):
        lines: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for p in usable:
            shape = p["point"]["shape"]
            lines.setdefault((shape["hidden"], shape["vocab"], shape["layers" if axis == "expert" else "experts"]),
                             []).append(p)
        for line in lines.values():
            line.sort(key=lambda p: _measured(p)["instances"][axis])
            for a, b in zip(line, line[1:]):
                added = _measured(b)["instances"][axis] - _measured(a)["instances"][axis]
                if added > 0:
                    seconds = _compile_seconds(b) - _compile_seconds(a)
                    out.append({"axis": axis, "from": a["name"], "to": b["name"], "added": added,
                                "seconds_per_added": seconds / added})
    return out


def extrapolate(fitted: dict[str, Any], points: Sequence[dict[str, Any]], target: Target) -> dict[str, Any]:
    """The fitted costs of one rank of `target` and of a trainer rank's connect to one engine of it."""
    out: dict[str, Any] = {"label": target.label, "engine": target.engine, "tp": target.tp, "ep": target.ep}
    if "error" in fitted:
        return out | {"error": fitted["error"]}
    hf_config = archs.config(target.shape)
    specs = archs.hf_specs(hf_config)
    structures = archs.rank_structures(hf_config, specs, target.engine, target.ep)
    out |= {
        "parameters": sum(archs.elements(specs).values()), **structures,
        "experts_per_rank": archs.experts_per_rank(hf_config, target.engine, target.ep),
    }
    parts = [c * x for c, x in zip(fitted["costs"].values(), _row(structures))]
    per_rank = sum(parts)
    group = largest_group(points, specs, out["experts_per_rank"])
    return out | {
        "seconds_per_engine_rank": per_rank, "seconds_per_connect": per_rank * target.tp,
        "seconds_by_structure": {s: parts[i] + parts[i + len(archs.STRUCTURES)] for i, s in enumerate(archs.STRUCTURES)},
        "largest_group_elements": group,
        "peak_bytes": None if group is None else fitted["bytes_per_group_element"] * group + fitted["bytes_constant"],
    }


def largest_group(points: Sequence[dict[str, Any]], specs: dict[str, Any], experts_per_rank: int) -> int | None:
    """Input elements of the largest group of a rank of the model of `specs`, from the group
    structures the points compiled (None where none of them maps onto that model)."""
    sizes = archs.masked_sizes(specs)
    found = [
        archs.template_elements(tmpl, sizes, experts_per_rank / max(1, rank["experts_per_layer"]))
        for p in points if "error" not in p for rank in p["ranks"] for tmpl in rank["group_templates"]
    ]
    known = [n for n in found if n is not None]
    return max(known) if known else None
