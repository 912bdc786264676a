"""pytest plugin of the conformance suite (entry point `pytest11: p2psync`).

Test classes declare what they exercise with a class attribute, e.g.
`conformance = {"trainer": "fsdp2", "engine": "torch", "transport": "mooncake"}`;
a test parametrized over an argument named `trainer`, `engine` or `transport`
takes that part of its combination from the parameter; `device` (cpu, cuda: the
GPU variants) likewise, cpu where a test does not say.
Options (or $P2PSYNC_TRAINER / $P2PSYNC_ENGINE / $P2PSYNC_TRANSPORT, comma
separated) keep only the chosen adapters; the run ends with a table of every
combination: passed, failed, or skipped with the reason. A skip never counts as
a pass.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import pytest

from .table import Outcome, format_table, merge

KINDS = ("trainer", "engine", "transport", "device")
_OUTCOMES: dict[str, Outcome] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("p2psync", "p2psync conformance")
    for kind in KINDS:
        group.addoption(
            f"--p2psync-{kind}", action="append", default=None, metavar="NAME",
            help=f"run only conformance tests of this {kind} (repeatable; default: all, or ${_env(kind)})",
        )
    group.addoption("--p2psync-results", metavar="FILE", help="write the combination outcomes to FILE (JSON)")


def _env(kind: str) -> str:
    return f"P2PSYNC_{kind.upper()}"


def picks(config: pytest.Config) -> dict[str, set[str] | None]:
    """The chosen names per kind, or None for all."""
    out: dict[str, set[str] | None] = {}
    for kind in KINDS:
        chosen = config.getoption(f"--p2psync-{kind}") or [n for n in os.environ.get(_env(kind), "").split(",") if n]
        out[kind] = set(chosen) or None
    return out


def combination(item: pytest.Item) -> dict[str, str] | None:
    declared = getattr(getattr(item, "cls", None), "conformance", None)
    if declared is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {"device": "cpu", **declared, **{k: str(params[k]) for k in KINDS if k in params}}


def pytest_report_header(config: pytest.Config) -> list[str]:
    chosen = picks(config)
    lines = ["p2psync conformance: " + ", ".join(f"{k}={','.join(sorted(v)) if v else 'all'}" for k, v in chosen.items())]
    versions = []
    for package in ("p2psync", "torch", "mooncake-transfer-engine-non-cuda", "nixl-cu12", "sglang", "vllm", "megatron-core"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    lines.append("p2psync versions: " + ", ".join(versions))
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = picks(config)
    keep, drop = [], []
    for item in items:
        combo = combination(item)
        wanted = combo is None or all(
            chosen[k] is None or combo.get(k) is None or combo[k] in chosen[k] for k in KINDS
        )
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):
    outcome = yield
    report = outcome.get_result()
    combo = combination(item)
    if combo is None or (report.when != "call" and not report.failed and not report.skipped):
        return
    key = json.dumps({k: combo.get(k, "-") for k in KINDS}, sort_keys=True)
    status = "passed" if report.passed else "failed" if report.failed else "skipped"
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    _OUTCOMES[key] = merge(_OUTCOMES.get(key), Outcome(status, reason))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not _OUTCOMES:
        return
    rows = {tuple(json.loads(k)[kind] for kind in KINDS): v for k, v in _OUTCOMES.items()}
    terminalreporter.section("p2psync conformance: trainer x engine x transport")
    terminalreporter.write_line(format_table(rows))
    path = config.getoption("--p2psync-results")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps([[*k, v.status, v.reason] for k, v in rows.items()], indent=1))
