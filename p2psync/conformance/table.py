"""The trainer x engine x transport (x device) table, from one run or merged from several
(one tox environment per engine): `python p2psync/conformance/table.py DIR`. Plain
Python, so that it runs where p2psync is not installed (tox's matrix environment)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
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


def main(args: Sequence[str]) -> int:
    """`table.py DIR`: print the merged table of every result file in DIR; exit 1 if
    any combination failed or there are none. `table.py --clear DIR`: empty DIR
    first, so that a run shows only its own results."""
    if args[:1] == ["--clear"]:
        folder = Path(args[1])
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.json"):
            old.unlink()
        return 0
    rows: dict[tuple[str, str, str, str], Outcome] = {}
    for path in sorted(Path(args[0]).glob("*.json")):
        for trainer, engine, transport, device, status, reason in json.loads(path.read_text()):
            key = (trainer, engine, transport, device)
            rows[key] = merge(rows.get(key), Outcome(status, reason))
    if not rows:
        print(f"no conformance results in {args[0]}", file=sys.stderr)
        return 1
    print(format_table(rows))
    return 1 if any(o.status == "failed" for o in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
