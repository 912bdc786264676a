"""The miles table (anchors.md) with the plan's link model: broadcast vs P2P from 1 to 32 nodes.

Predictions, not measurements. The published times include what the link model
leaves out (trainer gathers, miles' CPU replica load, engine pause/resume), so
the comparison is of the trend: broadcast's disadvantage grows with scale.
"""

from __future__ import annotations

import argparse
from typing import Any

from .cluster import Cluster
from .presets import preset

# model, trainer (TP, PP, CP, EP), nodes (each side), engine (TP, EP), engine dtype, published (broadcast, P2P) s
MILES = [
    ("GLM-4.7-Flash", (1, 1, 1, 8), 1, (4, 4), "bf16", (2.5, 4.2)),
    ("Qwen3-30B-A3B", (4, 1, 1, 8), 2, (8, 8), "bf16", (2.7, 2.2)),
    ("GLM-4.5-Air", (1, 4, 1, 8), 4, (8, 8), "bf16", (5.0, 2.6)),
    ("Qwen3-235B-A22B", (4, 4, 2, 16), 8, (32, 32), "bf16", (10.8, 3.2)),
    ("GLM-5", (4, 8, 2, 16), 16, (64, 64), "bf16", (58.3, 8.5)),
    ("Kimi-K2", (8, 8, 4, 32), 32, (32, 32), "fp8", (53.3, 7.2)),
]
#: Rows whose trainer layout miles did not publish: ASSUMED here (GLM-4.7-Flash: one node, as GLM-4.5-Air's TP1 EP8).
ASSUMED_TRAINER = {"GLM-4.7-Flash"}
PERPLEXITY_KIMI_S = 1.3


# Perplexity's Kimi-K2 setup (anchors.md): 256 bf16 training GPUs -> 128 fp8 inference GPUs. Their layouts are
# not published: ASSUMED here trainer TP8 PP8 EP32 (as miles) and 4 engines of TP32 EP32 (16 nodes).
PERPLEXITY_ASSUMED = dict(train_ranks=256, train_tp=8, train_pp=8, train_ep=32, engines=4, engine_tp=32, engine_ep=32,
                          engine_dtype="fp8")


def perplexity(nic_gbps: float = 400.0, latency_us: float = 5.0, broadcast: str = "ring") -> dict[str, Any]:
    from .command import plan_dict

    cluster = Cluster(**PERPLEXITY_ASSUMED, nic_gbps=nic_gbps, latency_us=latency_us)
    d = plan_dict(preset("Kimi-K2"), "Kimi-K2", cluster, "auto", broadcast)
    return {"predicted_p2p_s": d["p2p"]["predicted_s"], "predicted_broadcast_s": d["broadcast"]["predicted_s"],
            "published_s": PERPLEXITY_KIMI_S, "assumed": PERPLEXITY_ASSUMED}


def compare(
    shapes: str = "auto", nic_gbps: float = 400.0, latency_us: float = 5.0, broadcast: str = "ring"
) -> list[dict[str, Any]]:
    from .command import plan_dict

    rows = []
    for model, (tp, pp, cp, ep), nodes, (etp, eep), dtype, (pub_b, pub_p) in MILES:
        cluster = Cluster(
            train_ranks=nodes * 8, train_tp=tp, train_pp=pp, train_ep=ep, engines=nodes * 8 // etp, engine_tp=etp,
            engine_ep=eep, engine_dtype=dtype, nic_gbps=nic_gbps, latency_us=latency_us,
        )
        d = plan_dict(preset(model), model, cluster, shapes, broadcast)  # fp8: analytic, saying why
        rows.append({
            "model": model, "nodes": nodes,
            "trainer": f"TP{tp} PP{pp} CP{cp} EP{ep}" + (" (ASSUMED)" if model in ASSUMED_TRAINER else ""),
            "engines": f"{cluster.engines} x TP{etp} EP{eep} {dtype}", "shapes": d["shapes"],
            "predicted_broadcast_s": d["broadcast"]["predicted_s"], "predicted_p2p_s": d["p2p"]["predicted_s"],
            "predicted_ratio": d["broadcast_over_p2p"], "published_broadcast_s": pub_b, "published_p2p_s": pub_p,
            "published_ratio": pub_b / pub_p, "plan_build_s": d["plan_build_s"],
        })
    return rows


def _perplexity_line(args: argparse.Namespace | None) -> list[str]:
    get = lambda name, default: getattr(args, name, default)  # noqa: E731
    p = perplexity(get("nic_gbps", 400.0), get("latency_us", 5.0), get("broadcast", "ring"))
    return [
        f"Kimi-K2 (Perplexity's 256 -> 128 GPUs, layouts ASSUMED: trainer TP8 PP8 EP32, engines 4 x TP32 EP32 fp8): "
        f"PREDICTED P2P {p['predicted_p2p_s']:.2f} s, broadcast {p['predicted_broadcast_s']:.1f} s; published "
        f"Perplexity {p['published_s']} s."
    ]


def format_compare(rows: list[dict[str, Any]], args: argparse.Namespace | None = None) -> str:
    gbps = getattr(args, "nic_gbps", 400.0)
    bmodel = getattr(args, "broadcast", "ring")
    lines = [
        f"miles table vs p2psync plan's link model ({gbps:g} Gb/s x 8 NICs per node, broadcast {bmodel}); "
        "predicted = PREDICTION from the link model, published = miles' measurement (H100)",
        "",
        "| model | nodes | trainer | engines | predicted broadcast s | predicted P2P s | predicted ratio "
        "| published broadcast s | published P2P s | published ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['trainer']} | {r['engines']} | {r['predicted_broadcast_s']:.2f} "
            f"| {r['predicted_p2p_s']:.3f} | {r['predicted_ratio']:.1f}x | {r['published_broadcast_s']} "
            f"| {r['published_p2p_s']} | {r['published_ratio']:.1f}x |"
        )
    kimi = next(r for r in rows if r["model"] == "Kimi-K2")
    lines += [
        "",
        f"Kimi-K2 (miles setup, 256 -> 8 x TP32 EP32 fp8): PREDICTED P2P {kimi['predicted_p2p_s']:.2f} s, "
        f"broadcast {kimi['predicted_broadcast_s']:.1f} s; published: miles P2P {kimi['published_p2p_s']} s "
        f"(broadcast {kimi['published_broadcast_s']} s), Perplexity {PERPLEXITY_KIMI_S} s (256 bf16 training GPUs -> "
        "128 fp8 inference GPUs, another setup).",
        *_perplexity_line(args),
        "Shapes per row: " + "; ".join(f"{r['model']}: {r['shapes']}" for r in rows),
        "Not in the link model (present in the published times): trainer gathers, layout/replica work "
        "(miles' CPU replica load), engine pause/resume/post-processing.",
    ]
    return "\n".join(lines)
