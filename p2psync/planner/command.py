"""`p2psync plan`: arguments and the command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .presets import PRESETS
from .setups import SETUPS


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="model from public architecture numbers (no download)")
    src.add_argument("--config", help="path to an HF config.json")
    src.add_argument("--setup", choices=[s.name for s in SETUPS],
                     help="a published setup (model and cluster; see --compare-miles), beside its published time")
    t = p.add_argument_group(
        "trainer", "every rank of a pipeline stage holds the stage's tensors after gathering and sends: TP/EP/ETP "
        "decide the gathers, PP and the engines the bytes on the wire"
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
    e.add_argument("--engine-dp-attention", action="store_true", help="every engine rank holds the whole attention")
    n = p.add_argument_group("network")
    n.add_argument("--nodes", type=int, help="node count of the trainer and of the engines (each)")
    n.add_argument("--train-nodes", type=int)
    n.add_argument("--engine-nodes", type=int)
    n.add_argument("--gpus-per-node", type=int, default=8)
    n.add_argument("--nics-per-node", type=int, default=8)
    n.add_argument("--nic-gbps", type=float, default=400.0, help="per NIC and direction, Gb/s (default 400)")
    n.add_argument("--nvlink-gbytes", type=float, default=360.0,
                   help="all-gather bandwidth per GPU inside a node, GB/s (default 360)")
    n.add_argument("--latency-us", type=float, default=5.0, help="per message (default 5)")
    c = p.add_argument_group("costs outside the wire (see `p2psync.planner.update.Costs` for the defaults' sources)")
    c.add_argument("--produce-gbytes", type=float, default=1000.0,
                   help="GB/s per GPU of producing the bytes (copy map, quantization) and of engine loaders")
    c.add_argument("--pause-s", type=float, default=0.05, help="engine pause (default 0.05 s)")
    c.add_argument("--finish-s", type=float, default=0.05, help="engine finish: cache flush, resume (default 0.05 s)")
    c.add_argument("--post-load-gbytes", type=float,
                   help="engine post-load GB/s per rank (default: fp8 37.8, from Kimi-K2's published 884 ms; bf16 none)")
    d = p.add_argument_group("delta updates (p2psync's delta mode as a further way)")
    d.add_argument("--delta-fraction", type=float, metavar="F",
                   help="fraction of the engines' elements that change per update (e.g. 0.01)")
    d.add_argument("--delta-compare-gbytes", type=float, default=300.0,
                   help="GB/s per sender of comparing with the baseline (default 300: in GPU memory)")
    p.add_argument("--shapes", choices=("auto", "sglang", "analytic"), default="auto",
                   help="auto: sglang's own model on meta when sglang imports (bf16), else the analytic model")
    p.add_argument("--broadcast", choices=("ring", "star", "tree"), default="ring",
                   help="broadcast path model (default ring: NCCL's; tree: gloo's binomial tree)")
    p.add_argument("--png", help="draw the per-NIC load into this PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--compare-miles", action="store_true",
                   help="every row of miles' table and the other published setups, predicted against published")


def _links(args: argparse.Namespace) -> dict[str, Any]:
    return dict(nic_gbps=args.nic_gbps, nvlink_gbytes=args.nvlink_gbytes, latency_us=args.latency_us)


def _costs(args: argparse.Namespace) -> Any:
    from .update import Costs

    return Costs(produce_gbytes=args.produce_gbytes, pause_s=args.pause_s, finish_s=args.finish_s,
                 post_load_gbytes=args.post_load_gbytes)


def _delta(args: argparse.Namespace) -> Any:
    from .delta import DeltaCosts

    if args.delta_fraction is None:
        return None
    return DeltaCosts(args.delta_fraction, args.delta_compare_gbytes)


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
        gpus_per_node=gpn, nics_per_node=args.nics_per_node, engine_dtype=args.engine_dtype,
        engine_dp_attention=args.engine_dp_attention, trainer_dtype=args.trainer_dtype, **_links(args),
    )


def run(args: argparse.Namespace) -> int:
    from .plan import plan_dict
    from .report import format_text

    try:
        if args.compare_miles:
            from .compare import compare, format_compare

            rows = compare(args.shapes, args.broadcast, _costs(args), **_links(args))
            print(json.dumps(rows, indent=2) if args.json else format_compare(rows))
            return 0
        published = None
        if args.setup:
            from .presets import preset
            from .setups import setup

            chosen = setup(args.setup)
            cfg, model, cluster = preset(chosen.model), chosen.model, chosen.make_cluster(**_links(args))
            published = chosen
        elif args.preset:
            from .presets import preset

            cfg, model, cluster = preset(args.preset), args.preset, cluster_from(args)
        elif args.config:
            with open(args.config) as f:
                cfg = json.load(f)
            model, cluster = args.config, cluster_from(args)
        else:
            print("p2psync plan: give --preset, --config or --setup (or --compare-miles)", file=sys.stderr)
            return 2
        d = plan_dict(cfg, model, cluster, args.shapes, args.broadcast, _costs(args), _delta(args))
        if published is not None:
            d["published"] = [dict(way=p.way, low_s=p.low_s, high_s=p.high_s, system=p.system)
                              for p in published.published]
            d["assumed"] = published.assumed
        if args.png:
            from .report import draw_png

            draw_png(d, args.png)
    except (ValueError, RuntimeError, OSError, KeyError) as exc:
        print(f"p2psync plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=2) if args.json else format_text(d))
    if args.png and not args.json:
        print(f"  per-NIC load drawn to {args.png}")
    return 0
