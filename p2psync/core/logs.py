"""Logging that carries the rank: every line says which process wrote it."""

from __future__ import annotations

import logging
import os


def configure(role: str, level: int | str | None = None) -> None:
    """Log to stderr as `<time> [<role>] <logger>: <message>`; `role` is e.g. "trainer 1"
    or "engine e0 rank 0". Level from the argument or $P2PSYNC_LOG (default WARNING)."""
    level = level or os.environ.get("P2PSYNC_LOG", "WARNING")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [{role}] %(name)s: %(message)s",
        force=True,
    )
