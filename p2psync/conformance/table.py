"""The trainer x engine x transport (x device) table, from one run or merged from several
(one tox environment per engine): `python -m p2psync.conformance.table FILE...`."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_RANK = {"failed": 3, "skipped": 2, "passed": 1}


@dataclass(frozen=True)
class Outcome:
    status: str
    reason: str = ""


def merge(old: Outcome | None, new: Outcome) -> Outcome:
    """A combination's outcome over its tests: any failure fails it, any skip skips it."""
    if old is None or _RANK[new.status] > _RANK[old.status]:
        return new
    return old


def format_table(rows: Mapping[tuple[str, str, str, str], Outcome]) -> str:
    header = ("trainer", "engine", "transport", "device", "result")
    lines = [
        (*key, outcome.status + (f" ({outcome.reason})" if outcome.reason else ""))
        for key, outcome in sorted(rows.items())
    ]
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(4)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, [*widths, 0]))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, [*widths, 0])) for line in lines]
    return "\n".join(out)


def main(paths: Sequence[str]) -> int:
    """Print the merged table of several result files; exit 1 if any combination failed."""
    rows: dict[tuple[str, str, str, str], Outcome] = {}
    for path in paths:
        try:
            entries = json.loads(open(path).read())
        except FileNotFoundError:
            print(f"{path}: no results (did that environment run?)", file=sys.stderr)
            return 1
        for trainer, engine, transport, device, status, reason in entries:
            key = (trainer, engine, transport, device)
            rows[key] = merge(rows.get(key), Outcome(status, reason))
    print(format_table(rows))
    return 1 if any(o.status == "failed" for o in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
