"""The connect bench's plot: compile seconds per engine rank and the compile's peak memory
against the model's parameters, measured points and extrapolations (matplotlib, if installed).

It needs nothing of p2psync: the engine environments have no matplotlib, so saved results can
be drawn by any Python that has it, `python p2psync/bench/connect_plot.py RESULT.json...`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> str:
    """Draw `result` into the PNG `path`; what was done, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed in this environment"
    measured = [p for p in result["points"] if "error" not in p]
    guessed = [e for e in result["extrapolations"] if "error" not in e]
    figure, (seconds, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    params = [p["parameters"] for p in measured]
    seconds.scatter(params, [p["cpu_seconds"]["compile"] / len(p["ranks"]) for p in measured],
                    label="compile (CPU s), measured")
    seconds.scatter(params, [max(p["seconds"]["second_compile"], 1e-4) for p in measured], marker="x",
                    label="second compile (cached), measured")
    memory.scatter(params, [p["added_bytes"]["compile"] / 1e6 for p in measured], label="compile, measured")
    for i, e in enumerate(guessed):
        mark = dict(marker="^", color=f"C{i + 2}", label=f"{e['label']}, fitted")
        seconds.scatter([e["parameters"]], [e["seconds_per_engine_rank"]], **mark)
        if e["peak_bytes"] is not None:
            memory.scatter([e["parameters"]], [e["peak_bytes"] / 1e6], **mark)
    setup = result["setup"]
    for axes, label in ((seconds, "seconds per engine rank"), (memory, "peak RSS above the compile's start, MB")):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("model parameters")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle(f"p2psync connect: {setup['model']['arch']} shapes, {setup['engine']['kind']} TP "
                    f"{setup['engine']['tp']} x EP {setup['engine']['ep']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot saved to {path}"


def main(argv: list[str]) -> int:
    """Plot saved results, each into a PNG beside its JSON."""
    import json

    for name in argv:
        path = Path(name)
        print(plot(json.loads(path.read_text()), path.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
