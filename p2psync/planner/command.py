"""`p2psync plan`: arguments and the command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .presets import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="model from public architecture numbers (no download)")
    src.add_argument("--config", help="path to an HF config.json")
    t = p.add_argument_group(
        "trainer", "every rank of a pipeline stage holds the stage's tensors after gathering and sends: TP/EP/ETP are "
        "checked and shown, the bytes on the wire depend on PP and the engines"
    )
    t.add_argument("--train-ranks", type=int, help="trainer ranks (default: trainer nodes x GPUs per node)")
    t.add_argument("--train-tp", type=int, default=1)
    t.add_argument("--train-pp", type=int, default=1, help="pipeline stages = sender groups")
    t.add_argument("--train-ep", type=int, default=1)
    t.add_argument("--train-etp", type=int, default=1)
    t.add_argument("--trainer-dtype", default="bf16", help="bf16 (default), fp16 or fp32: bytes a stage holds gathered")
    e = p.add_argument_group("engines")
    e.add_argument("--engines", type=int, help="engine count (default: engine nodes x GPUs per node / engine TP)")
    e.add_argument("--engine-tp", type=int, default=8)
    e.add_argument("--engine-ep", type=int, default=1)
    e.add_argument("--engine-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: block-quantized linear weights (1 byte) with float32 128x128 scales")
    n = p.add_argument_group("network")
    n.add_argument("--nodes", type=int, help="node count of the trainer and of the engines (each)")
    n.add_argument("--train-nodes", type=int)
    n.add_argument("--engine-nodes", type=int)
    n.add_argument("--gpus-per-node", type=int, default=8)
    n.add_argument("--nics-per-node", type=int, default=8)
    n.add_argument("--nic-gbps", type=float, default=400.0, help="per NIC and direction (default 400)")
    n.add_argument("--latency-us", type=float, default=5.0, help="per message (default 5)")
    p.add_argument("--shapes", choices=("auto", "sglang", "analytic"), default="auto",
                   help="auto: sglang's own model on meta when sglang imports (bf16), else the analytic model")
    p.add_argument("--broadcast", choices=("ring", "star"), default="ring", help="broadcast path model (default ring)")
    p.add_argument("--png", help="draw the per-NIC load into this PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--compare-miles", action="store_true",
                   help="the miles table's setups (anchors.md) with this link model, beside the published times")


def cluster_from(args: argparse.Namespace) -> Any:
    from .cluster import Cluster

    gpn = args.gpus_per_node
    train_nodes = args.train_nodes or args.nodes
    engine_nodes = args.engine_nodes or args.nodes or train_nodes
    ranks = args.train_ranks or (train_nodes * gpn if train_nodes else args.train_tp * args.train_pp)
    if args.engines:
        engines = args.engines
    elif engine_nodes:
        engines = max(1, engine_nodes * gpn // args.engine_tp)
    else:
        engines = 1
    return Cluster(
        train_ranks=ranks, train_tp=args.train_tp, train_pp=args.train_pp, train_ep=args.train_ep,
        train_etp=args.train_etp, engines=engines, engine_tp=args.engine_tp, engine_ep=args.engine_ep,
        gpus_per_node=gpn, nics_per_node=args.nics_per_node, nic_gbps=args.nic_gbps, engine_dtype=args.engine_dtype,
        trainer_dtype=args.trainer_dtype, latency_us=args.latency_us,
    )


def plan_dict(cfg: dict[str, Any], model: str, cluster: Any, shapes: str = "auto", broadcast: str = "ring") -> dict:
    from .engine import shapes_for
    from .predict import predict
    from .report import to_dict
    from .shapes import analytic_shapes

    t0 = time.perf_counter()
    sm = shapes_for(cfg, cluster.engine_tp, cluster.engine_ep, cluster.engine_dtype, shapes)
    t1 = time.perf_counter()
    d = to_dict(predict(cluster, sm, broadcast), model)
    d["shapes_s"], d["plans_s"] = t1 - t0, d["plan_build_s"]
    # what each pipeline stage holds gathered, as HF tensors in the trainer's dtype (analytic, unsharded)
    trainer = analytic_shapes(cfg, 1, 1, cluster.trainer_dtype)
    for s in d["stages"]:
        layers = cluster.stage_layers(s["stage"], len(trainer.layer_kinds))
        first, last = s["stage"] == 0, s["stage"] == cluster.train_pp - 1
        s["held_bytes_trainer_dtype"] = trainer.full_bytes(layers, first, last)[0]
    d["plan_build_s"] = time.perf_counter() - t0
    return d


def run(args: argparse.Namespace) -> int:
    if args.compare_miles:
        from .miles import compare, format_compare

        rows = compare(shapes=args.shapes, nic_gbps=args.nic_gbps, latency_us=args.latency_us,
                       broadcast=args.broadcast)
        if args.json:
            from .miles import perplexity

            extra = perplexity(args.nic_gbps, args.latency_us, args.broadcast)
            print(json.dumps({"miles": rows, "perplexity_kimi_k2": extra}, indent=2))
        else:
            print(format_compare(rows, args))
        return 0
    if not (args.preset or args.config):
        print("p2psync plan: give --preset or --config (or --compare-miles)", file=sys.stderr)
        return 2
    try:
        if args.preset:
            from .presets import preset

            cfg, model = preset(args.preset), args.preset
        else:
            with open(args.config) as f:
                cfg = json.load(f)
            model = args.config
        cluster = cluster_from(args)
        d = plan_dict(cfg, model, cluster, args.shapes, args.broadcast)
        if args.png:
            from .report import draw_png

            draw_png(d, args.png)
    except (ValueError, RuntimeError, OSError, KeyError) as exc:
        print(f"p2psync plan: {exc}", file=sys.stderr)
        return 2
    from .report import format_text

    print(json.dumps(d, indent=2) if args.json else format_text(d))
    if args.png and not args.json:
        print(f"  per-NIC load drawn to {args.png}")
    return 0
