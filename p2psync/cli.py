"""The `p2psync` command: `plugins`, `demo`, `bench`, `plan`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _plugins(args: argparse.Namespace) -> int:
    from .core.plugins import registry

    rows = []
    for reg in registry().all():
        ok, why = reg.dependency_status()
        rows.append((reg.kind.rstrip("s").replace("_", " "), reg.name, f"{reg.package} {reg.version}", "yes" if ok else f"no ({why})"))
    widths = [max(len(r[i]) for r in rows + [("kind", "name", "package", "usable")]) for i in range(3)]
    print(f"{'kind':<{widths[0]}}  {'name':<{widths[1]}}  {'package':<{widths[2]}}  usable")
    for kind, name, package, usable in rows:
        print(f"{kind:<{widths[0]}}  {name:<{widths[1]}}  {package:<{widths[2]}}  {usable}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .core.devices import resolve
    from .core.errors import P2PSyncError
    from .demo import CONFIGS, DemoOptions, run

    if args.size not in CONFIGS:
        print(f"unknown size {args.size!r}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    try:
        args.device = resolve(args.device).device
    except P2PSyncError as exc:
        print(f"p2psync demo: {exc}", file=sys.stderr)
        return 2
    opts = DemoOptions(
        size=args.size, trainers=args.trainers, engines=args.engines, updates=args.updates, transport=args.transport,
        device=args.device,
    )
    print(
        f"p2psync demo: {opts.trainers} FSDP2 trainer ranks -> {opts.engines} torch engines over {opts.transport}, "
        f"Qwen3-style model '{opts.size}', {opts.updates} updates, device {opts.device}",
        flush=True,
    )
    result = run(opts)
    ok = True
    for report, generations in zip(result.reports, result.generations):
        print(report.format())
        expected = generations["trainer"]
        for engine in sorted(report.engines):
            got = generations.get(engine)
            same = got == expected
            ok &= same and report.engines[engine].ok
            print(f"    {engine}: greedy generation {'equals' if same else 'DIFFERS from'} the trainer's {expected}")
    print("demo passed" if ok else "demo FAILED")
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchOptions, format_report, run_bench
    from .trainer.options import SessionOptions

    opts = BenchOptions(
        size=args.size or ("100m" if args.engine == "torch" else "moe"), trainers=args.trainers, engines=args.engines,
        updates=args.updates, warmup=args.warmup, transport=args.transport, raw_bytes=args.raw_mib << 20,
        engine=args.engine, engine_tp=args.engine_tp, ways=tuple(args.ways or ()), engine_dtype=args.engine_dtype,
        delta_lrs=tuple(args.lr),
    )
    if args.gather != "always" and not args.delta:
        print("p2psync bench: --gather is for --delta (the other bench compares both ways itself)", file=sys.stderr)
        return 2
    opts.session = SessionOptions.of(opts.session, gather=args.gather)
    if args.delta:
        from .bench.delta import format_delta, run_delta_bench

        return _run_bench(args, lambda: run_delta_bench(opts), format_delta, "delta", lambda r: r["verified"])
    return _run_bench(
        args, lambda: run_bench(opts), format_report, "", lambda r: all(w["verified"] for w in r["ways"].values())
    )


def _run_bench(
    args: argparse.Namespace, run: Callable[[], dict[str, Any]], text: Callable[[dict[str, Any]], str], folder: str,
    verified: Callable[[dict[str, Any]], bool],
) -> int:
    """Run a bench, print it (`text`, or JSON), save it into `--save`'s `folder`; 1 if it did not verify."""
    import json
    from pathlib import Path

    from .bench import save

    try:
        result = run()
    except ValueError as exc:
        print(f"p2psync bench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text(result))
    if args.save:
        print(f"saved to {save(result, Path(args.save) / folder)}", file=sys.stderr)
    return 0 if verified(result) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2psync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list installed trainer sources, engine targets and transports").set_defaults(
        func=_plugins
    )
    demo = sub.add_parser("demo", help="FSDP2 trainer -> torch engines on this machine, verified")
    demo.add_argument("--size", default="100m", help="model size: 100m (default) or tiny")
    demo.add_argument("--trainers", type=int, default=2)
    demo.add_argument("--engines", type=int, default=2)
    demo.add_argument("--updates", type=int, default=3)
    demo.add_argument("--transport", default="mooncake")
    demo.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto")
    demo.set_defaults(func=_demo)
    from .bench.engines import KINDS
    from .bench.model import MOE_CONFIGS
    from .bench.ways import WAYS
    from .demo import CONFIGS

    bench = sub.add_parser("bench", help="p2psync against the best torch.distributed broadcast, on this machine")
    bench.add_argument(
        "--engine", default="torch", choices=KINDS,
        help="engine ranks: torch (default: the demo's dense Qwen3, full tensors per engine), sglang or vllm "
        "(the engine's own TP ranks of a Qwen3-MoE in bfloat16; needs sglang 0.5.23 or vllm 0.33.0 installed)",
    )
    bench.add_argument("--engine-tp", type=int, default=2, help="TP ranks per sglang or vLLM engine (default 2)")
    bench.add_argument(
        "--size", choices=sorted(CONFIGS) + sorted(MOE_CONFIGS),
        help=f"model size: {', '.join(sorted(CONFIGS))} for torch engines (default 100m), "
        f"{', '.join(sorted(MOE_CONFIGS))} (Qwen3-MoE) for sglang and vllm (default moe)",
    )
    bench.add_argument("--trainers", type=int, default=2)
    bench.add_argument("--engines", type=int, default=2)
    bench.add_argument("--updates", type=int, default=3, help="timed updates per way (the median is reported)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed updates per way before them")
    bench.add_argument("--ways", nargs="+", choices=WAYS,
                       help="the ways to compare (default: every way the engines offer)")
    bench.add_argument("--transport", default="mooncake")
    bench.add_argument("--engine-dtype", help="torch engines' parameter dtype (default: the trainer's float32; "
                       "--delta: bfloat16)")
    bench.add_argument("--delta", action="store_true",
                       help="delta updates against full ones and the broadcast, the trainer taking AdamW steps "
                       "(torch engines)")
    bench.add_argument("--gather", choices=["always", "auto"], default="always",
                       help="--delta: how the delta session sends (auto: gather-free, each rank's deltas of its own "
                       "shards; the full update and the broadcast gather)")
    bench.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                       help="--delta: the learning rates, each run in turn (default 1e-6 1e-5)")
    bench.add_argument("--raw-mib", type=int, default=512, help="size of the memcpy and raw transport measurements")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--save", nargs="?", const="benchmarks/results", metavar="DIR",
                       help="also write the result as JSON into DIR (default benchmarks/results)")
    bench.set_defaults(func=_bench)
    from .planner.command import add_arguments as _plan_arguments, run as _plan

    plan = sub.add_parser("plan", help="the real plan at cluster scale from per-rank shapes; predicted update times")
    _plan_arguments(plan)
    plan.set_defaults(func=_plan)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
