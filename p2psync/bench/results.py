"""Keeping bench results: what machine and versions a run had, and `save`, which writes the
whole result as JSON into a results folder (benchmarks/results/ in the repository, whose
README tables `benchmarks/tables.py` generates from those files)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: Distributions whose versions decide a run's figures (those installed are recorded).
DISTRIBUTIONS = (
    "p2psync", "torch", "transformers", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "nixl-cu12",
    "sglang", "vllm",
)


def machine() -> dict[str, Any]:
    """The machine: processor, cores, memory, kernel, Python."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal:")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def versions(engine: str) -> dict[str, str]:
    """Installed versions of the distributions that matter, and the source tree's git commit
    (with `-dirty` when it has uncommitted changes)."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    found["p2psync_source"] = _commit(Path(__file__).resolve().parent)
    found["engine"] = engine
    return found


def _commit(where: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def save(result: dict[str, Any], directory: str | Path) -> Path:
    """Write `result` as `<directory>/<UTC time>-<engine>-<size>.json` (a cluster in a box's run:
    `...-<size>-cluster-<topology>-<rate>gbit.json`); return the path."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(result.get("started", time.time())))
    setup = result["setup"]
    name = f"{stamp}-{setup['engine']['kind']}-{setup['model']['size']}"
    if setup.get("cluster"):
        topology = re.sub(r"[^A-Za-z0-9]+", "_", setup["cluster"]["name"])
        name += f"-cluster-{topology}-{setup['cluster']['link_gbit']:g}gbit"
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return path
