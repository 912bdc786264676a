"""Logging that says who wrote each line: the job, the side (a trainer, or which engine) and
the rank, in every process p2psync runs in, its own or a framework's (a verl actor, an sglang
scheduler, a Ray worker).

A Session and an engine endpoint name their process (`identify`). From then on every line
p2psync's loggers write starts with `[job J trainer 0]` or `[job J engine rollout-1 rank 0]`,
whatever the application's own log format. `$P2PSYNC_LOG` (a level) or `$P2PSYNC_LOG_FORMAT`
(`text` or `json`) set in a process give p2psync's loggers a handler of their own there (on
stderr, at that level, in that format: one JSON object per line with `time`, `level`,
`logger`, `job`, `side`, `rank`, `message`); unset, the application's handlers show them.
p2psync's own processes (the demo, the bench, the worlds) call `configure` instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

LEVEL_ENV = "P2PSYNC_LOG"
FORMAT_ENV = "P2PSYNC_LOG_FORMAT"
FORMATS = ("text", "json")

_who: dict[str, str] = {}
#: Who a process of p2psync's own is (`configure`'s role) until `identify` names it.
_who_fallback = ""
#: Set by `configure` and by a handler of p2psync's own: its format shows who, so lines need no prefix.
_own_format = False


def identify(*, job: str, side: str, rank: int) -> None:
    """Name this process in p2psync's log lines: `side` is "trainer" or "engine <id>"."""
    _who.update(job=job, side=side, rank=str(rank))
    if not _own_format and (os.environ.get(LEVEL_ENV) or os.environ.get(FORMAT_ENV)):
        _handle_p2psync_lines()


def who() -> str:
    """This process as its lines name it ("job J trainer 0"), or "" before `identify`."""
    if not _who:
        return _who_fallback
    side = _who["side"]
    rank = f" rank {_who['rank']}" if side.startswith("engine") else f" {_who['rank']}"
    return f"job {_who['job']} {side}{rank}"


def configure(role: str, level: int | str | None = None) -> None:
    """Log every logger of this process (one of p2psync's own) to stderr, naming it `role`
    (e.g. "trainer 1" or "e0 rank 0") until a Session or endpoint identifies it. Level from the
    argument or $P2PSYNC_LOG (default WARNING), format from $P2PSYNC_LOG_FORMAT."""
    global _who_fallback, _own_format
    _who_fallback, _own_format = role, True
    handler = logging.StreamHandler()
    handler.setFormatter(_formatter())
    logging.basicConfig(level=level or os.environ.get(LEVEL_ENV, "WARNING"), handlers=[handler], force=True)


def _handle_p2psync_lines() -> None:
    """Give p2psync's loggers a handler of their own in a process whose logging the application
    owns (asked for by $P2PSYNC_LOG or $P2PSYNC_LOG_FORMAT)."""
    global _own_format
    _own_format = True
    logger = logging.getLogger("p2psync")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter())
    logger.handlers[:] = [handler]
    logger.setLevel(os.environ.get(LEVEL_ENV, "WARNING"))
    logger.propagate = False


def _formatter() -> logging.Formatter:
    kind = os.environ.get(FORMAT_ENV, "text")
    if kind not in FORMATS:
        raise ValueError(f"${FORMAT_ENV} is {kind!r}; it is one of {', '.join(FORMATS)}")
    if kind == "json":
        return _JsonFormatter()
    return logging.Formatter("%(asctime)s [%(p2psync_who)s] %(name)s: %(message)s", defaults={"p2psync_who": ""})


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record), "level": record.levelname, "logger": record.name,
            "job": _who.get("job"), "side": _who.get("side") or _who_fallback or None,
            "rank": int(_who["rank"]) if "rank" in _who else None, "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


_make_record = logging.getLogRecordFactory()


def _record(*args: Any, **kwargs: Any) -> logging.LogRecord:
    """Every record carries `p2psync_who`; p2psync's own say who in their message where the
    application's format cannot."""
    record = _make_record(*args, **kwargs)
    record.p2psync_who = name = who()
    if not _own_format and _who and (record.name == "p2psync" or record.name.startswith("p2psync.")):
        record.msg, record.args = f"[{name}] {record.getMessage()}", ()
    return record


logging.setLogRecordFactory(_record)
