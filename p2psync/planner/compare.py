"""Predicted against published: every public setup (`setups.SETUPS`: miles' table, Perplexity,
vLLM's sharded_rdt, NeMo-RL) planned with the whole-update model, beside its published time,
with the error of each prediction."""

from __future__ import annotations

from typing import Any

from .plan import plan_dict
from .presets import preset
from .setups import SETUPS
from .update import Costs

#: What each published way is compared with among the predicted ways.
PREDICTED_WAY = {"broadcast": "broadcast", "p2p": "p2psync", "gather-free": "gather-free"}


def compare(
    shapes: str = "auto", broadcast: str = "ring", costs: Costs | None = None, **links: Any
) -> list[dict[str, Any]]:
    """One row per published figure of every setup. `links`: `Cluster` link fields
    (`nic_gbps`, `nvlink_gbytes`, `latency_us`)."""
    rows = []
    for s in SETUPS:
        d = plan_dict(preset(s.model), s.model, s.make_cluster(**links), shapes, broadcast, costs)
        ways = d["update"]["ways"]
        for pub in s.published:
            predicted = ways[PREDICTED_WAY[pub.way]]
            middle = (pub.low_s + pub.high_s) / 2
            rows.append({
                "setup": s.name, "group": s.group, "hardware": s.hardware, "assumed": s.assumed,
                "trainer": _trainer(d["cluster"]), "engines": _engines(d["cluster"]), "shapes": d["shapes"],
                "published_way": pub.way, "published_system": pub.system, "published_s": [pub.low_s, pub.high_s],
                "predicted_way": PREDICTED_WAY[pub.way], "predicted": predicted,
                "predicted_s": predicted["total_s"], "error": predicted["total_s"] / middle - 1,
                "within_published_range": pub.low_s <= predicted["total_s"] <= pub.high_s,
                "all_ways_s": {name: way["total_s"] for name, way in ways.items()}, "model": d["update"]["model"],
                "notes": list(s.notes),
            })
    return rows


def _trainer(c: dict[str, Any]) -> str:
    return f"{c['train_ranks']} ranks TP{c['train_tp']} PP{c['train_pp']} EP{c['train_ep']}"


def _engines(c: dict[str, Any]) -> str:
    dp = " DP-attention" if c["engine_dp_attention"] else ""
    return f"{c['engines']} x TP{c['engine_tp']} EP{c['engine_ep']}{dp} {c['engine_dtype']}"


def _published(row: dict[str, Any]) -> str:
    low, high = row["published_s"]
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def format_compare(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, then the whole-update model and the assumptions."""
    lines = [
        "p2psync plan --compare-miles: PREDICTED whole updates (a model, not a measurement) against PUBLISHED times",
        "",
        "| setup | trainer | engines | published (way, system) | published s | predicted way | gathers s "
        "| production s | wire s | control s | predicted s | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["predicted"]
        control = p["pause_s"] + p["finish_s"] + p["post_load_s"]
        lines.append(
            f"| {r['setup']} | {r['trainer']} | {r['engines']} | {r['published_way']}, {r['published_system']} "
            f"| {_published(r)} | {r['predicted_way']} | {p['gathers_s']:.2f} | {p['production_s']:.2f} "
            f"| {p['wire_s']:.2f} | {control:.2f} | {p['total_s']:.2f} "
            f"| {r['error']:+.0%} |"
        )
    lines += ["", f"whole-update model: {rows[0]['model']}"]
    assumed = {r["setup"]: r["assumed"] for r in rows if r["assumed"]}
    lines += [f"  {name}: ASSUMED {what}" for name, what in assumed.items()]
    for note in sorted({n for r in rows for n in r["notes"]}):
        lines.append(f"  note: {note}")
    lines.append("  shapes: " + "; ".join(sorted({f"{r['setup']}: {r['shapes']}" for r in rows})))
    return "\n".join(lines)
