"""The `p2psync` command: `plugins`, `demo`, `bench`, `plan`, `rendezvous`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
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
        f"Qwen3-style model '{opts.size}', {opts.updates} updates, device {opts.device}\n"
        f"  its engines while it runs: "
        f"p2psync status --rendezvous 127.0.0.1:{opts.rendezvous_port} --job {opts.job_id}",
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


#: `p2psync bench` flags of --connect only (their defaults are None or False), and flags --connect refuses.
_CONNECT_ONLY = (
    "arch", "layers", "experts", "hidden", "vocab", "engine_ep", "all_ranks", "max_rss_gb", "point_timeout",
)
_NOT_CONNECT = ("size", "ways", "engine_dtype", "delta", "lora", "trainer", "fp8")


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchOptions, format_report, run_bench
    from .trainer.options import SessionOptions

    if args.connect:
        return _bench_connect(args)
    given = [f"--{name.replace('_', '-')}" for name in _CONNECT_ONLY if getattr(args, name) not in (None, False)]
    if given:
        print(f"p2psync bench: {', '.join(given)} are options of --connect", file=sys.stderr)
        return 2
    try:
        topology = _topology(args)
    except ValueError as exc:
        print(f"p2psync bench: {exc}", file=sys.stderr)
        return 2
    opts = BenchOptions(
        size=args.size or ("100m" if args.engine == "torch" else "moe"), updates=args.updates, warmup=args.warmup,
        transport=args.transport, raw_bytes=args.raw_mib << 20, engine=args.engine, ways=tuple(args.ways or ()),
        engine_dtype=args.engine_dtype, fp8=args.fp8, delta_lrs=tuple(args.lr), trainer=args.trainer or "fsdp2",
        trainers=topology.trainers if topology else args.trainers or 2,
        engines=topology.engines if topology else args.engines or 2,
        engine_tp=topology.tp if topology else 2 if args.engine_tp is None else args.engine_tp, cluster=topology,
    )
    if args.fp8 is not None and (args.delta or args.lora):
        print("p2psync bench: --fp8 is a case of the bench of the ways, not of --delta or --lora", file=sys.stderr)
        return 2
    if args.delta and args.trainer not in (None, "fsdp2"):
        print("p2psync bench: --delta runs FSDP2 trainer ranks", file=sys.stderr)
        return 2
    if args.gather is not None and not args.delta:
        print("p2psync bench: --gather is for --delta (the other bench compares both ways itself)", file=sys.stderr)
        return 2
    if args.gather is not None:
        opts.session = SessionOptions.of(opts.session, gather=args.gather)
    if args.lora:
        other = [flag for flag, given in (("--delta", args.delta), ("--cluster", topology), ("--ways", args.ways),
                                          ("--engine", args.engine != "torch")) if given]
        if other:
            print(f"p2psync bench: --lora runs alone, on a torch engine ({', '.join(other)} given)", file=sys.stderr)
            return 2
        from .bench.lora import format_lora, run_lora_bench

        return _run_bench(args, lambda: run_lora_bench(opts), format_lora, "lora", lambda r: r["verified"])
    if args.delta:
        from .bench.delta import format_delta, run_delta_bench

        return _run_bench(args, lambda: run_delta_bench(opts), format_delta, "delta", lambda r: r["verified"])
    return _run_bench(
        args, lambda: run_bench(opts), format_report, "", lambda r: all(w["verified"] for w in r["ways"].values())
    )


def _topology(args: argparse.Namespace) -> Any:
    """The cluster in a box that --cluster names, with its link (None without --cluster)."""
    link_flags = {"--link-gbit": args.link_gbit, "--nic": args.nic, "--latency-ms": args.latency_ms,
                  "--loss-percent": args.loss_percent}
    if args.cluster is None:
        given = [flag for flag, value in link_flags.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} shape the links of a --cluster")
        return None
    ranks = [f"--{flag}" for flag in ("trainers", "engines", "engine_tp") if getattr(args, flag) is not None]
    if ranks:
        raise ValueError(f"--cluster's topology says how many ranks run; {', '.join(ranks)} would contradict it")
    from .bench.cluster import Topology
    from .worlds.netbox import Link

    link = Link(gbit=args.link_gbit or 1.0, latency_ms=args.latency_ms or 0.0, loss_percent=args.loss_percent or 0.0)
    return Topology.parse(args.cluster, link, args.nic or "rank")


def _bench_connect(args: argparse.Namespace) -> int:
    """`p2psync bench --connect`: the connect bench (`bench.connect`)."""
    given = [f"--{name.replace('_', '-')}" for name in _NOT_CONNECT if getattr(args, name) not in (None, False)]
    if given:
        print(f"p2psync bench --connect: {', '.join(given)} are not options of --connect", file=sys.stderr)
        return 2
    if args.engine == "torch":
        print("p2psync bench --connect: choose --engine sglang or --engine vllm", file=sys.stderr)
        return 2
    from .bench.connect import ConnectOptions, format_connect, run_connect_bench, verified
    from .bench.connect_plot import plot

    fields: dict[str, Any] = {
        "engine": args.engine, "arch": args.arch, "tp": args.engine_tp, "ep": args.engine_ep,
        **{name: tuple(getattr(args, name) or ()) for name in ("layers", "experts", "hidden", "vocab")},
        "all_ranks": args.all_ranks,
        "max_rss_bytes": None if args.max_rss_gb is None else int(args.max_rss_gb * (1 << 30)),
        "timeout_s": args.point_timeout,
    }
    try:
        opts = ConnectOptions(**{k: v for k, v in fields.items() if v not in (None, ())})
    except ValueError as exc:
        print(f"p2psync bench --connect: {exc}", file=sys.stderr)
        return 2
    return _run_bench(args, lambda: run_connect_bench(opts), format_connect, "connect", verified, plot)


def _run_bench(
    args: argparse.Namespace, run: Callable[[], dict[str, Any]], text: Callable[[dict[str, Any]], str], folder: str,
    verified: Callable[[dict[str, Any]], bool], draw: Callable[[dict[str, Any], Path], str] | None = None,
) -> int:
    """Run a bench, print it (`text`, or JSON), save it into `--save`'s `folder` (and `draw` its
    plot beside it); 1 if it did not verify."""
    import json

    from .bench import save

    try:
        result = run()
    except ValueError as exc:
        print(f"p2psync bench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text(result))
    if args.save:
        path = save(result, Path(args.save) / folder)
        print(f"saved to {path}", file=sys.stderr)
        if draw is not None:
            print(draw(result, path.with_suffix(".png")), file=sys.stderr)
    return 0 if verified(result) else 1


def _rendezvous(args: argparse.Namespace) -> int:
    """Serve a rendezvous store until stopped: a job's rendezvous that outlives its trainers
    and engines (every job id has its own keys in it; tokens never go through it)."""
    import signal
    import threading

    from .core.host import local_host
    from .core.rendezvous import Rendezvous

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host = args.host or local_host()
    server = Rendezvous(host=host, port=args.port, job_id="rendezvous", is_server=True)
    print(f"p2psync rendezvous serving at {host}:{server.port} (until stopped): give the job's trainers and engines "
          f"Rendezvous(host={host!r}, port={server.port}, job_id=...)", flush=True)
    stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .core.version import VERSION

    parser = argparse.ArgumentParser(prog="p2psync", description=__doc__)
    parser.add_argument("--version", action="version", version=f"p2psync {VERSION}")
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
    from .bench.options import TRAINERS
    from .bench.ways import WAYS
    from .demo import CONFIGS

    bench = sub.add_parser("bench", help="p2psync against the best torch.distributed broadcast, on this machine")
    bench.add_argument(
        "--engine", default="torch", choices=KINDS,
        help="engine ranks: torch (default: the demo's dense Qwen3, full tensors per engine), sglang or vllm "
        "(the engine's own TP ranks of a Qwen3-MoE in bfloat16; needs sglang 0.5.23 or vllm 0.33.0 installed)",
    )
    bench.add_argument("--engine-tp", type=int, help="TP ranks per sglang or vLLM engine (default 2; --connect: 4)")
    bench.add_argument(
        "--size", choices=sorted(CONFIGS) + sorted(MOE_CONFIGS),
        help=f"model size: {', '.join(sorted(CONFIGS))} for torch engines (default 100m), "
        f"{', '.join(sorted(MOE_CONFIGS))} (Qwen3-MoE) for sglang and vllm (default moe)",
    )
    bench.add_argument("--trainers", type=int, help="trainer ranks (default 2)")
    bench.add_argument("--trainer", choices=list(TRAINERS),
                       help="fsdp2 (default), or megatron: Megatron-Core with TP and, for the experts, EP over the trainer ranks "
                       "(sglang and vLLM engines)")
    bench.add_argument("--engines", type=int, help="engines (default 2)")
    bench.add_argument("--updates", type=int, default=3, help="timed updates per way (the median is reported)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed updates per way before them")
    bench.add_argument("--ways", nargs="+", choices=WAYS,
                       help="the ways to compare (default: every way the engines offer)")
    bench.add_argument("--transport", default="mooncake")
    bench.add_argument("--engine-dtype", help="torch engines' parameter dtype (default: the trainer's float32; "
                       "--delta: bfloat16)")
    bench.add_argument("--fp8", metavar="QUANTIZER",
                       help="sglang engines serve an fp8 checkpoint quantized by QUANTIZER (block-linear, "
                       "block-linear-verl-torch, block-ue8m0 or per-tensor; blocks [128, 128], smaller where the TP "
                       "shards need it), and every way quantizes on the trainer")
    bench.add_argument("--delta", action="store_true",
                       help="delta updates against full ones and the broadcast, the trainer taking AdamW steps "
                       "(torch engines)")
    bench.add_argument("--lora", action="store_true",
                       help="a LoRA adapter's update (rank 16 on every linear projection) against the full update "
                       "of the same model: bytes per engine rank and time (one trainer rank, one torch engine; "
                       "needs p2psync[lora])")
    bench.add_argument("--gather", choices=["always", "auto"],
                       help="--delta: how the delta session sends (default auto, the session's default: gather-free, "
                       "each rank's deltas of its own shards; always: gathered; the full update and the broadcast "
                       "gather)")
    bench.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                       help="--delta: the learning rates, each run in turn (default 1e-6 1e-5)")
    bench.add_argument("--raw-mib", type=int, default=512, help="size of the memcpy and raw transport measurements")
    from .bench.cluster import PRESETS

    box = bench.add_argument_group(
        "--cluster", "the bench as emulated nodes in a cluster in a box: a network namespace of its own (root) whose "
        "loopback links between nodes are shaped with tc (iproute2), inside a node unshaped; bytes per NIC measured",
    )
    box.add_argument("--cluster", metavar="TOPOLOGY",
                     help="; ".join(f"{k}: {v}" for k, v in PRESETS.items()) + " (TRAINERS[,TRAINERS...]:ENGINESxTP: "
                     "trainer ranks per trainer node, then engines of TP ranks, each engine on a node of its own)")
    box.add_argument("--link-gbit", type=float, help="each NIC's rate out, Gbit/s (default 1)")
    box.add_argument("--nic", choices=["rank", "node"], help="one NIC per rank (default, rail-optimized) or per node")
    box.add_argument("--latency-ms", type=float, help="latency added to every packet a NIC sends (needs iptables: apt-get install iptables)")
    box.add_argument("--loss-percent", type=float, help="packets a NIC loses: 100/2^k percent (6.25, 3.125, ...)")
    from .bench.archs import ARCHS

    connect = bench.add_argument_group(
        "--connect", "what a trainer rank's connect costs per phase (tables, rank models, layouts compiled, a second "
        "compile), and its peak memory, for sglang or vLLM layouts of a growing MoE model, with no engine processes; "
        "each configuration in a process of its own; fitted per structure and extrapolated to Kimi-K2 and the full "
        "Qwen3-30B-A3B",
    )
    connect.add_argument("--connect", action="store_true", help="run the connect bench (needs --engine sglang or vllm)")
    connect.add_argument("--arch", choices=ARCHS,
                         help="the model's architecture and dimensions (default Qwen3-30B-A3B)")
    connect.add_argument("--layers", type=int, nargs="+", help="decoder layer counts to sweep (default 1 2 4)")
    connect.add_argument("--experts", type=int, nargs="+", help="routed expert counts to sweep (default 8 32)")
    connect.add_argument("--hidden", type=int, nargs="+", help="hidden sizes to sweep (default: the architecture's)")
    connect.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes to sweep (default 8192; the fit "
                         "scales the embedding's cost to the architecture's own)")
    connect.add_argument("--engine-ep", type=int, help="expert-parallel ranks (default: sglang --engine-tp, vLLM 1)")
    connect.add_argument("--all-ranks", action="store_true", help="compile every engine rank's layout (default rank 0)")
    connect.add_argument("--max-rss-gb", type=float, help="kill a configuration past this resident memory (default 6)")
    connect.add_argument("--point-timeout", type=float, help="kill a configuration after these seconds (default 3600)")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--save", nargs="?", const="benchmarks/results", metavar="DIR",
                       help="also write the result as JSON into DIR (default benchmarks/results)")
    bench.set_defaults(func=_bench)
    from .planner.command import add_arguments as _plan_arguments, run as _plan

    plan = sub.add_parser("plan", help="the real plan at cluster scale from per-rank shapes; predicted update times")
    _plan_arguments(plan)
    plan.set_defaults(func=_plan)
    rendezvous = sub.add_parser("rendezvous", help="serve a job's rendezvous on its own, until stopped")
    rendezvous.add_argument("--host", help="the address to serve at (default: $P2PSYNC_HOST, else 127.0.0.1)")
    rendezvous.add_argument("--port", type=int, default=29400, help="the port (default 29400; 0: a free one)")
    rendezvous.set_defaults(func=_rendezvous)
    from .status import add_arguments as _status_arguments, run as _status

    status = sub.add_parser("status", help="a job's engines: each rank's version, whether it serves, its last update")
    _status_arguments(status)
    status.set_defaults(func=_status)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
