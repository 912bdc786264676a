"""pytest plugin of the conformance suite (entry point `pytest11: p2psync`).

Tests declare what they exercise: a class attribute, e.g. `conformance = {"trainer":
"fsdp2", "engine": "torch", "transport": "mooncake"}`, or a marker on a function,
`@pytest.mark.conformance(trainer=..., engine=..., transport=..., via=...)` (`via`: the
integration a test goes through, e.g. "verl"). A test parametrized over an argument named
`trainer`, `engine`, `transport`, `device` or `via` takes that part of its combination
from the parameter; device is cpu where a test does not say.

Options (or $P2PSYNC_TRAINER / ... comma separated) keep only the chosen adapters;
`--p2psync-env NAME` keeps exactly the combinations that the expectations file (ini
option `p2psync_expectations`, a JSON file read by `table.py`) lists for environment NAME.
The run ends with a table of every combination: passed, failed, skipped with the reason,
or missing (expected, not run); `--p2psync-results FILE` writes it for `table.py`. A skip
never counts as a pass.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import pytest

from .table import KINDS, Key, Outcome, format_table, key_of, load_expectations, merge


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("p2psync", "p2psync conformance")
    for kind in KINDS:
        group.addoption(
            f"--p2psync-{kind}", action="append", default=None, metavar="NAME",
            help=f"run only conformance tests of this {kind} (repeatable; default: all, or ${_env(kind)})",
        )
    group.addoption("--p2psync-env", metavar="NAME", help="run exactly the combinations expected of environment NAME")
    group.addoption("--p2psync-results", metavar="FILE", help="write the combination outcomes to FILE (JSON)")
    parser.addini("p2psync_expectations", "JSON file: per environment, the combinations it must run", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "conformance(**parts): the trainer/engine/transport/device/via combination a test exercises"
    )
    config.pluginmanager.register(Recorder(config), "p2psync-conformance-recorder")


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
    """What `item` exercises (see the module docstring), or None for a test outside the matrix."""
    declared = getattr(getattr(item, "cls", None), "conformance", None)
    marker = item.get_closest_marker("conformance")
    if marker is not None:
        declared = {**(declared or {}), **marker.kwargs}
    if declared is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {"device": "cpu", **declared, **{k: str(params[k]) for k in KINDS if k in params}}


def expected(config: pytest.Config) -> list[Key] | None:
    """The combinations expected of `--p2psync-env`, or None without one."""
    env = config.getoption("--p2psync-env")
    if not env:
        return None
    path = config.getini("p2psync_expectations")
    if not path:
        raise pytest.UsageError("--p2psync-env needs the ini option p2psync_expectations (the expectations file)")
    expectations = load_expectations(Path(config.rootpath, path))
    if env not in expectations:
        raise pytest.UsageError(f"the expectations file {path} has no environment {env!r}")
    return expectations[env]


def pytest_report_header(config: pytest.Config) -> list[str]:
    chosen = picks(config)
    lines = ["p2psync conformance: " + ", ".join(f"{k}={','.join(sorted(v)) if v else 'all'}" for k, v in chosen.items())]
    if config.getoption("--p2psync-env"):
        lines.append(f"p2psync conformance environment: {config.getoption('--p2psync-env')}")
    versions = []
    for package in ("p2psync", "torch", "mooncake-transfer-engine-non-cuda", "nixl-cu12", "sglang", "vllm", "megatron-core"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    lines.append("p2psync versions: " + ", ".join(versions))
    return lines


#: The user property that carries a test's combination (its table key) on its reports.
COMBINATION = "p2psync_combination"


def _combination_key(report: pytest.TestReport) -> Key | None:
    """The combination a test's report names (`Recorder.pytest_runtest_makereport`), if any."""
    for name, value in report.user_properties:
        if name == COMBINATION:
            return tuple(cast("list[str]", value))
    return None


class Recorder:
    """One run's combinations: selects them, records their outcomes, writes and prints the table."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.expected = expected(config)
        self.outcomes: dict[Key, Outcome] = {}
        self.collect_skips: list[str] = []

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        chosen = picks(config)
        wanted_keys = self.expected
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for item in items:
            combo = combination(item)
            wanted = combo is None or all(
                allowed is None or combo.get(k) is None or combo[k] in allowed for k, allowed in chosen.items()
            )
            if combo is not None and wanted_keys is not None:
                wanted = wanted and key_of(combo) in wanted_keys
            (keep if wanted else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped or failing at import leaves no items: say so where its rows are missing."""
        if report.skipped and isinstance(report.longrepr, tuple):
            self.collect_skips.append(f"{report.nodeid} skipped: {str(report.longrepr[2]).removeprefix('Skipped: ')}")
        elif report.failed:
            last = str(report.longrepr).strip().splitlines()[-1:] or ["?"]
            self.collect_skips.append(f"{report.nodeid} failed to import: {last[0].removeprefix('E   ').strip()}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
        """Name the test's combination on its reports: under pytest-xdist a worker makes them and
        the controller, which holds the table, sees only the reports."""
        outcome = yield
        combo = combination(item)
        if combo is not None:
            outcome.get_result().user_properties.append((COMBINATION, list(key_of(combo))))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        key = _combination_key(report)
        if key is None or (report.when != "call" and not report.failed and not report.skipped):
            return
        status = "passed" if report.passed else "failed" if report.failed else "skipped"
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        self.outcomes[key] = merge(self.outcomes.get(key), Outcome(status, reason))

    def rows(self) -> dict[Key, Outcome]:
        """This run's outcomes, and the expected combinations it did not run as missing."""
        out = dict(self.outcomes)
        for key in self.expected or []:
            out.setdefault(key, Outcome("missing", "; ".join(self.collect_skips) or "not collected or deselected"))
        return out

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        path = self.config.getoption("--p2psync-results")
        if path and not hasattr(self.config, "workerinput"):  # an xdist worker's outcomes are the controller's
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({
                "env": self.config.getoption("--p2psync-env") or Path(path).stem,
                "exitstatus": int(exitstatus),
                "rows": [[*k, v.status, v.reason] for k, v in sorted(self.rows().items())],
                "collect_skips": self.collect_skips,
            }, indent=1))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        table = self.rows()
        if not table:
            return
        env = self.config.getoption("--p2psync-env") or "this run"
        terminalreporter.section("p2psync conformance: trainer x engine x transport x device x via")
        terminalreporter.write_line(format_table({k: (env, v) for k, v in table.items()}))
