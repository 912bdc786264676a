"""The conformance table: every trainer x engine x transport (x device, x integration) combination
of every environment, what each environment was expected to run, and whether the matrix as a
whole passed. Plain Python (no p2psync, no pytest), so that it runs where p2psync is not
installed (tox's matrix environment):

    python p2psync/conformance/table.py --clear DIR
    python p2psync/conformance/table.py DIR --expect EXPECTATIONS.json [--envs A,B]

Each environment's pytest run (with `--p2psync-env NAME --p2psync-results DIR/NAME.json`)
writes one results file. EXPECTATIONS.json maps each environment to the combinations it
must run (see `expected_rows`). The matrix fails when any environment's pytest failed, an
expected environment produced no results, an expected combination is missing, a
combination failed, or every combination of one trainer, engine, transport or integration
was skipped or missing (a broken install would otherwise look green).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The columns of a combination, in order; "-" where a test does not exercise that part.
KINDS = ("trainer", "engine", "transport", "device", "via")
_RANK = {"failed": 4, "missing": 3, "skipped": 2, "passed": 1}

Key = tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    status: str  # passed, failed, skipped or missing
    reason: str = ""

    def text(self) -> str:
        return self.status + (f" ({self.reason})" if self.reason else "")


def merge(old: Outcome | None, new: Outcome) -> Outcome:
    """A combination's outcome over its tests: any failure fails it, any skip skips it."""
    if old is None or _RANK[new.status] > _RANK[old.status]:
        return new
    return old


def key_of(combination: Mapping[str, str]) -> Key:
    """The table key of a combination; parts it does not name are "-" (device: "cpu")."""
    defaults = {"device": "cpu"}
    return tuple(str(combination.get(kind, defaults.get(kind, "-"))) for kind in KINDS)


def expected_rows(patterns: Iterable[Mapping[str, Sequence[str] | str]]) -> list[Key]:
    """The keys an environment declares: each pattern names lists of values per kind (a
    missing kind is "-", device "cpu") and stands for every combination of them."""
    keys: list[Key] = []
    for pattern in patterns:
        unknown = set(pattern) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)} in expectation {dict(pattern)}; kinds: {KINDS}")
        values = []
        for kind in KINDS:
            v = pattern.get(kind, "cpu" if kind == "device" else "-")
            values.append([v] if isinstance(v, str) else list(v))
        keys += [tuple(k) for k in itertools.product(*values)]
    return list(dict.fromkeys(keys))


def load_expectations(path: str | Path) -> dict[str, list[Key]]:
    return {env: expected_rows(patterns) for env, patterns in json.loads(Path(path).read_text()).items()}


@dataclass
class Matrix:
    """Rows (key -> (environment, outcome)) and the problems that fail the matrix."""

    rows: dict[Key, tuple[str, Outcome]]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def build(results: Mapping[str, Mapping[str, Any]], expectations: Mapping[str, Sequence[Key]]) -> Matrix:
    """The matrix of `results` (environment -> its results file's content) against
    `expectations` (environment -> expected keys)."""
    rows: dict[Key, tuple[str, Outcome]] = {}
    problems: list[str] = []
    for env in sorted(set(results) | set(expectations)):
        expected = list(expectations.get(env, []))
        result = results.get(env)
        if result is None:
            problems.append(f"environment {env} produced no results")
            for key in expected:
                _put(rows, key, env, Outcome("missing", f"{env} produced no results"))
            continue
        if result.get("exitstatus", 0) != 0:
            problems.append(f"environment {env}: pytest exited with status {result['exitstatus']}")
        seen: dict[Key, Outcome] = {}
        for *parts, status, reason in result.get("rows", []):
            key = tuple(parts)
            seen[key] = merge(seen.get(key), Outcome(status, reason))
        why_missing = "; ".join(result.get("collect_skips", [])) or f"not run in {env}"
        for key in expected:
            seen.setdefault(key, Outcome("missing", why_missing))
        for key, outcome in seen.items():
            _put(rows, key, env, outcome)
    for key, (env, outcome) in sorted(rows.items()):
        if outcome.status in ("failed", "missing"):
            problems.append(f"{env}: {' x '.join(p for p in key if p != '-')}: {outcome.text()}")
    problems += _nothing_ran(rows, expectations)
    return Matrix(rows, problems)


def _put(rows: dict[Key, tuple[str, Outcome]], key: Key, env: str, outcome: Outcome) -> None:
    old = rows.get(key)
    rows[key] = (env, merge(old[1] if old else None, outcome))


def _nothing_ran(rows: Mapping[Key, tuple[str, Outcome]], expectations: Mapping[str, Sequence[Key]]) -> list[str]:
    """Each trainer, engine, transport or integration that some environment expects and that
    passed nowhere: everything of it was skipped or missing."""
    out = []
    expected = {key for keys in expectations.values() for key in keys}
    for i, kind in enumerate(KINDS):
        if kind == "device":
            continue
        for value in sorted({key[i] for key in expected} - {"-"}):
            mine = [rows[key][1] for key in rows if key[i] == value]
            if not any(o.status == "passed" for o in mine):
                reasons = sorted({o.reason for o in mine if o.reason})
                out.append(f"{kind} {value}: no combination passed (" + "; ".join(reasons[:3] or ["none ran"]) + ")")
    return out


def format_table(rows: Mapping[Key, tuple[str, Outcome]]) -> str:
    header = (*KINDS, "environment", "result")
    lines = [(*key, env, outcome.text()) for key, (env, outcome) in sorted(rows.items())]
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, [*widths, 0])).rstrip() for line in [header, *lines])


def main(args: Sequence[str]) -> int:
    """`table.py --clear DIR`: empty DIR, so that a run shows only its own results.
    `table.py DIR --expect FILE [--envs A,B]`: print the table, then what fails the matrix;
    exit 1 if anything does. `--envs` restricts the expectations to those environments."""
    if args[:1] == ["--clear"]:
        folder = Path(args[1])
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.json"):
            old.unlink()
        return 0
    folder, options = Path(args[0]), dict(zip(args[1::2], args[2::2]))
    expectations = load_expectations(options["--expect"]) if "--expect" in options else {}
    if options.get("--envs"):
        chosen = options["--envs"].split(",")
        expectations = {env: keys for env, keys in expectations.items() if env in chosen}
    results = {json.loads(p.read_text())["env"]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    matrix = build(results, expectations)
    if not matrix.rows:
        print(f"no conformance results in {folder} and none expected", file=sys.stderr)
        return 1
    print(format_table(matrix.rows))
    for problem in matrix.problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if matrix.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
