"""The cluster bench's plot: seconds per update against the link's rate, one line per way, one
panel per topology, from saved `p2psync bench --cluster --save` results (matplotlib, if
installed); each way's wire bound dotted beside it, and runs with fp8 engines as crosses.

It needs nothing of p2psync: the engine environments have no matplotlib, so saved results can
be drawn by any Python that has it, `python p2psync/bench/cluster_plot.py OUT.png RESULT.json...`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

#: The ways drawn, in the legend's order.
WAYS = ("gather-free", "p2p", "broadcast", "broadcast-chain", "broadcast-fp32")


def by_topology(results: list[dict[str, Any]], fp8: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Cluster results of bf16 engines (`fp8`: of fp8 engines) grouped by topology, each group
    by rising link rate, the latest run where several ran at one rate."""
    latest: dict[tuple[str, float], dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: r["started"]):
        topology = result["setup"].get("cluster")
        if topology and bool(result["setup"]["engine"].get("fp8")) == fp8:
            latest[topology["name"], topology["link_gbit"]] = result
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (name, _), result in sorted(latest.items()):
        groups[name].append(result)
    return dict(groups)


def plot(results: list[dict[str, Any]], path: Path) -> str:
    """Draw `results` into the PNG `path`; what was done, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed in this environment"
    groups, fp8_groups = by_topology(results), by_topology(results, fp8=True)
    if not groups:
        return "no plot: none of the results ran in a cluster in a box"
    figure, panels = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for axes, (name, runs) in zip(panels[0], groups.items()):
        for i, way in enumerate(w for w in WAYS if any(w in r["ways"] for r in runs)):
            points = [(r["setup"]["cluster"]["link_gbit"], r["ways"][way]) for r in runs if way in r["ways"]]
            rates = [rate for rate, _ in points]
            axes.plot(rates, [w["seconds"] for _, w in points], marker="o", color=f"C{i}", label=way)
            axes.plot(rates, [w["bound_seconds"] for _, w in points], linestyle=":", color=f"C{i}")
            fp8 = [(r["setup"]["cluster"]["link_gbit"], r["ways"][way]["seconds"]) for r in fp8_groups.get(name, [])
                   if way in r["ways"]]
            if fp8:
                axes.plot(*zip(*fp8), marker="x", linestyle="none", color=f"C{i}", label=f"{way}, fp8 engines")
        s = runs[0]["setup"]
        axes.set_title(f"({name}) {s['trainers']} trainer ranks -> {s['engines']} {s['engine']['kind']} x TP "
                       f"{s['engine']['tp']}", fontsize=9)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("link rate per NIC, Gbit/s")
        axes.set_ylabel("seconds per update (dotted: its bound)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle("p2psync in a cluster in a box: every rank its own NIC, inside a node unshaped")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot saved to {path}"


def main(argv: list[str]) -> int:
    """Plot saved cluster results (`argv[1:]`) into one PNG (`argv[0]`)."""
    import json

    if len(argv) < 2:
        print("usage: cluster_plot.py OUT.png RESULT.json...")
        return 2
    print(plot([json.loads(Path(name).read_text()) for name in argv[1:]], Path(argv[0])))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
