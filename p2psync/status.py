"""`p2psync status`: a job's engines, rank by rank, as each says itself: the version it holds,
whether it serves, and when its last update finished.

The engines are the ones the job's rendezvous lists (every engine id ever published there);
each rank is asked through its control route `info` with the job's token, so what is shown
is the engine's own word, not the trainer's report. A tool: it uses the rendezvous and the
control routes only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from .core.control import post
from .core.errors import P2PSyncError, first_line
from .core.rendezvous import Rendezvous


@dataclass(frozen=True)
class RankStatus:
    """One engine rank as it answered (`error`: why it did not)."""

    engine_id: str
    rank: int | None
    host: str = ""
    version: str | None = None
    serving: bool = False
    updating: str | None = None
    stale: str | None = None
    finished_at: float | None = None
    error: str | None = None

    @property
    def state(self) -> str:
        if self.error:
            return "unreachable" if self.rank is not None else "withdrawn"
        if self.serving:
            return "serving"
        if self.updating:
            return f"updating to {self.updating}"
        if self.stale:
            return "stale"
        return "waiting for its first update"


def job_status(rendezvous: Rendezvous, *, timeout: float = 3.0) -> list[RankStatus]:
    """Every rank of every engine the job's rendezvous lists (by engine id), as it answers within
    `timeout`."""
    out = []
    for engine_id in sorted(rendezvous.engine_ids()):
        try:
            tables = rendezvous.read_engine(engine_id, timeout=timeout)
        except P2PSyncError as exc:
            out.append(RankStatus(engine_id, None, error=f"no table in the rendezvous: {first_line(exc)}"))
            continue
        for table in tables:
            host = urlsplit(table.control_url).hostname or ""
            try:
                info = post(table.control_url, "info", token=rendezvous.token(), timeout=timeout)
            except P2PSyncError as exc:
                out.append(RankStatus(engine_id, table.rank, host, error=first_line(exc)))
                continue
            out.append(RankStatus(
                engine_id, table.rank, host, version=info["version"], serving=info["serving"],
                updating=info["updating"], stale=info["stale"], finished_at=info.get("finished_at"),
            ))
    return out


def format_status(ranks: Sequence[RankStatus], now: float | None = None) -> str:
    """A table, one line per rank, then why each one not serving is not."""
    now = time.time() if now is None else now
    header = ("engine", "rank", "host", "version", "state", "last update")
    rows = [
        (r.engine_id, "-" if r.rank is None else str(r.rank), r.host or "-", r.version or "-", r.state,
         f"{now - r.finished_at:.0f} s ago" if r.finished_at else "-")
        for r in ranks
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, [*widths, 0])).rstrip() for row in [header, *rows]]
    for r in ranks:
        why = r.error or r.stale
        if why:
            lines.append(f"{r.engine_id}{'' if r.rank is None else f' rank {r.rank}'}: {why}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rendezvous", required=True, metavar="HOST:PORT",
                        help="the job's rendezvous: host:port, or ray (the job's rendezvous actor; run inside the Ray "
                        "cluster)")
    parser.add_argument("--job", required=True, help="the job id")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds each engine rank may take to answer")
    parser.add_argument("--json", action="store_true", help="print one JSON object per rank")


def run(args: argparse.Namespace) -> int:
    """Print the job's status; exit 0 if every listed rank serves, 1 if any does not, 2 if the
    job lists no engine or its rendezvous does not answer."""
    from .adapters.ray import rendezvous_at

    try:
        rendezvous = rendezvous_at(args.rendezvous, job_id=args.job, timeout=args.timeout)
        ranks = job_status(rendezvous, timeout=args.timeout)
    except P2PSyncError as exc:
        print(f"p2psync status: {exc}", file=sys.stderr)
        return 2
    if not ranks:
        print(f"job {args.job!r} at {args.rendezvous}: no engine has published a table")
        return 2
    if args.json:
        for r in ranks:
            print(json.dumps({**asdict(r), "state": r.state}))
    else:
        print(format_status(ranks))
    return 0 if all(r.serving for r in ranks) else 1
