"""`p2psync bench --connect`: what a trainer rank's connect costs, phase by phase, for sglang and
vLLM layouts of growing MoE models, with no engine process: each engine rank's table is made
on meta as its endpoint publishes it, and the layouts are compiled through the trainer's
`LayoutCache` (see `connect_point` for the phases). Each configuration runs in a process of
its own, watched: killed past `max_rss_bytes` or `timeout_s`. From the points, per-structure
costs are fitted and extrapolated to Kimi-K2 and the full Qwen3-30B-A3B (`connect_fit`).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import results
from .archs import ARCHS, STRUCTURES, Shape
from .connect_fit import ASSUMPTIONS, Target, extrapolate, fit
from .connect_point import ENGINES, PHASES, Point

MB = 1e6


@dataclass(frozen=True)
class ConnectOptions:
    """The sweep: `arch` (a planner preset) at every combination of `layers`, `experts`, `hidden`
    (empty: the preset's hidden size) and `vocab` (empty: the preset's; by default a small one,
    since the presets' own make the embedding the largest group, several GB to compile, and the
    fit scales its cost to theirs), on
    `engine` ranks of TP `tp` with experts over `ep` (None: `tp` for sglang, 1 for vLLM);
    compiling engine rank 0's layout, or every rank's (`all_ranks`)."""

    engine: str = "sglang"
    arch: str = "Qwen3-30B-A3B"
    layers: tuple[int, ...] = (1, 2, 4)
    experts: tuple[int, ...] = (8, 32)
    hidden: tuple[int, ...] = ()
    vocab: tuple[int, ...] = (8192,)
    tp: int = 4
    ep: int | None = None
    all_ranks: bool = False
    #: A point's process is killed when its resident memory passes this.
    max_rss_bytes: int = 6 << 30
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"the connect bench compiles {', '.join(ENGINES)} layouts, not {self.engine!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; choose from {', '.join(ARCHS)}")
        if not self.layers or not self.experts:
            raise ValueError("sweep at least one layer count and one expert count")
        self.points()  # every point is valid

    @property
    def expert_parallel(self) -> int:
        return self.ep if self.ep is not None else (self.tp if self.engine == "sglang" else 1)

    def points(self) -> list[Point]:
        """Every configuration of the sweep, smallest first."""
        ranks = tuple(range(self.tp)) if self.all_ranks else (0,)
        return [
            Point(self.engine, Shape(self.arch, layers, experts, hidden, vocab), self.tp, self.expert_parallel, ranks)
            for vocab, hidden, layers, experts in itertools.product(
                sorted(self.vocab) or (None,), sorted(self.hidden) or (None,), sorted(self.layers), sorted(self.experts)
            )
        ]

    def targets(self) -> list[Target]:
        """What the fit is extrapolated to: Kimi-K2 on 32 ranks (sglang: experts over all 32), and
        the full Qwen3-30B-A3B on this sweep's layout."""
        kimi_ep = 32 if self.engine == "sglang" else 1
        return [
            Target(f"Kimi-K2, {self.engine} TP 32" + (" x EP 32" if kimi_ep > 1 else ""), Shape("Kimi-K2"),
                   self.engine, 32, kimi_ep),
            Target(f"Qwen3-30B-A3B, {self.engine} TP {self.tp}"
                   + (f" x EP {self.expert_parallel}" if self.expert_parallel > 1 else ""),
                   Shape("Qwen3-30B-A3B"), self.engine, self.tp, self.expert_parallel),
        ]


def run_point(point: Point, max_rss_bytes: int, timeout_s: float) -> dict[str, Any]:
    """Measure `point` in a process of its own (`connect_point`'s main), watching its resident
    memory; its result, or {"error": ...} with the end of its output."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path)
    with tempfile.TemporaryDirectory(prefix="p2psync-connect-") as tmp:
        given, out, log = Path(tmp) / "point.json", Path(tmp) / "result.json", Path(tmp) / "log.txt"
        given.write_text(json.dumps(point.to_json()))
        with log.open("wb") as sink:
            child = subprocess.Popen([sys.executable, "-m", "p2psync.bench.connect_point", str(given), str(out)],
                                     stdout=sink, stderr=subprocess.STDOUT, env=env)
            why = _watch(child, max_rss_bytes, timeout_s)
        if why is None and child.returncode == 0:
            result: dict[str, Any] = json.loads(out.read_text())
            return result
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        name = f"{point.engine}-tp{point.tp}-ep{point.ep}-{point.shape.name}"
        return {"point": point.to_json(), "name": name,
                "error": why or f"exited with {child.returncode}", "output_tail": tail}


def _watch(child: subprocess.Popen[bytes], max_rss_bytes: int, timeout_s: float) -> str | None:
    """Wait for `child`; kill it (and say why) past `max_rss_bytes` resident or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        resident = _resident(status)
        if resident > max_rss_bytes:
            child.kill()
            child.wait()
            return f"killed: resident memory {resident / MB:,.0f} MB passed the limit of {max_rss_bytes / MB:,.0f} MB"
        if time.monotonic() > deadline:
            child.kill()
            child.wait()
            return f"killed: still running after {timeout_s:.0f} s"
        time.sleep(0.2)
    return None


def _resident(status: Path) -> int:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process just ended
        pass
    return 0


def run_connect_bench(opts: ConnectOptions) -> dict[str, Any]:
    """Measure every point of the sweep (each in its own process), fit, extrapolate; the
    JSON-ready result."""
    about = {"machine": results.machine(), "versions": results.versions(opts.engine), "started": time.time()}
    points = []
    for i, point in enumerate(opts.points()):
        measured = run_point(point, opts.max_rss_bytes, opts.timeout_s)
        points.append(measured)
        print(f"[{i + 1}/{len(opts.points())}] {_progress(measured)}", file=sys.stderr, flush=True)
    fitted = fit(points)
    return {
        **about,
        "setup": {
            "mode": "connect", "engine": {"kind": opts.engine, "tp": opts.tp, "ep": opts.expert_parallel},
            "model": {"size": f"connect-{opts.arch}", "arch": opts.arch}, "ranks": "all" if opts.all_ranks else [0],
            "options": {**opts.__dict__, "ep": opts.expert_parallel},
        },
        "points": points, "fit": fitted,
        "extrapolations": [extrapolate(fitted, points, t) for t in opts.targets()],
        "assumptions": list(ASSUMPTIONS),
    }


def _progress(p: dict[str, Any]) -> str:
    if "error" in p:
        return f"{p['name']}: {p['error']}"
    return (f"{p['name']}: compile {p['seconds']['compile']:.1f} s, peak +{p['added_bytes']['compile'] / MB:,.0f} MB, "
            f"second compile {p['seconds']['second_compile']:.3f} s")


def verified(result: dict[str, Any]) -> bool:
    """Every point measured, and every second compile answered by the cache."""
    return all("error" not in p and p["second_compile_cached"] for p in result["points"])


def format_connect(result: dict[str, Any]) -> str:
    """The result as text: a row per point, the fit, the extrapolations and their assumptions."""
    setup = result["setup"]
    lines = [f"p2psync bench --connect: {setup['model']['arch']} shapes, {setup['engine']['kind']} TP "
             f"{setup['engine']['tp']} x EP {setup['engine']['ep']}, engine ranks {setup['ranks']} "
             "(no engine processes; "
             "tables made on meta, layouts through LayoutCache; wall seconds per phase, one thread per point; "
             "tables: the engine side, with the engine library's first import of its model classes)", ""]
    header = ["point", "params", "ranks", "groups (shared)", *[f"{ph} s" for ph in PHASES[1:]], "compile CPU s",
              "compile peak MB (above start / process)", "largest group M el.", "2nd cached"]
    rows = [_row(p) for p in result["points"]]
    lines += _table(header, rows)
    fitted = result["fit"]
    lines.append("")
    if "error" in fitted:
        lines.append(f"fit: {fitted['error']}")
    else:
        costs = fitted["costs"]
        per = ", ".join(f"{s} {costs[f'{s}_instance']:.2f} s + {costs[f'{s}_element'] * 1e9:.1f} ns/element"
                        for s in STRUCTURES)
        memory = ", ".join(f"{s} {b:.1f}" for s, b in fitted["bytes_per_group_element"].items())
        lines.append(f"fit ({fitted['model']}; CPU seconds of a rank's compile, per compiled instance of each "
                     f"structure): {per}; {costs['shared_group']:.3f} s per group renamed from another")
        lines.append(f"peak memory: bytes per input element of the largest group of each structure: {memory}")
        shared = fitted["sharing"]
        lines.append("layers shared: none measured (sweep 4 layers or more to see it)" if shared is None else
                     f"layers shared: {shared['point']} compiled {shared['compiled_layers']:.1f} of its "
                     f"{shared['layers']} layers, {shared['groups_per_layer']:g} groups per layer")
        lines += ["  " + f"{q['name']}: {q['compile_seconds_per_rank']:.1f} s measured, {q['fitted']:.1f} s fitted; "
                  f"{q['compile_added_bytes'] / MB:,.0f} MB measured, {_mb(q['fitted_bytes'])} MB bound"
                  for q in fitted["points"]]
    if fitted.get("marginal"):
        lines.append("measured growth (compile per engine rank, between points alike but in one size):")
        lines += [f"  +{m['added']:g} {m['axis']}{'s' if m['added'] != 1 else ''} ({m['from']} -> {m['to']}): "
                  f"{m['seconds_per_added']:.2f} s each" for m in fitted["marginal"]]
    lines += ["", "extrapolated (from the fit, not measured):"]
    lines += _table(["model, layout", "params", "experts/rank", "layers compiled", "s per engine rank",
                     "s per trainer rank's connect", "peak MB"], [_extrapolated(e) for e in result["extrapolations"]])
    lines += ["", "assumptions:"] + [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)


def _row(p: dict[str, Any]) -> list[str]:
    if "error" in p:
        return [p["name"], "-", "-", "-", *["-"] * len(PHASES), p["error"], "-", "-"]
    groups = ", ".join(f"{r['groups']} ({r['shared_groups'] if r['shared_groups'] is not None else '?'})"
                       for r in p["ranks"])
    peak = f"{p['added_bytes']['compile'] / MB:,.0f} / {p['peak_bytes']['compile'] / MB:,.0f}"
    largest = max(r["largest_group_elements"] for r in p["ranks"]) / 1e6
    return [p["name"], f"{p['parameters'] / 1e6:,.1f}M", str(len(p["ranks"])), groups,
            *[f"{p['seconds'][ph]:.2f}" for ph in PHASES[1:]], f"{p['cpu_seconds']['compile']:.2f}", peak,
            f"{largest:.1f}",
            "yes" if p["second_compile_cached"] else "NO"]


def _extrapolated(e: dict[str, Any]) -> list[str]:
    if "error" in e:
        return [e["label"], "-", "-", "-", e["error"], "-", "-"]
    head = [e["label"], f"{e['parameters'] / 1e9:,.1f}B", str(e["experts_per_rank"])]
    return head + [f"{e['compiled_layers']:.1f} of {e['instances']['layer']}", _duration(e["seconds_per_engine_rank"]),
                   _duration(e["seconds_per_connect"]), _mb(e["peak_bytes"])]


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:,.0f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
