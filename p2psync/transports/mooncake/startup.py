"""Mooncake's start-up noise, kept out of a good run's log.

Starting a Transfer Engine prints, through glog on the process's stderr, lines that
are not the user's business on a working setup: an error-level "Local segment
descriptor not found" (the P2P handshake has no metadata server to ask), "No RDMA
devices found" on TCP hosts, "Using default malloc/free". `initialize_quietly` captures
stderr for the call only: known noise goes to p2psync's debug log, anything else is
written back to stderr as it was, and a failed start-up carries what Mooncake said.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Lines Mooncake prints while starting on a healthy host (glog prefixes them with level and time).
NOISE = re.compile(
    r"Logging before InitGoogleLogging|Local segment descriptor not found|No RDMA devices found"
    r"|Found 0 HCAs?|Using default malloc/free"
)


class StartupFailed(Exception):
    """The start-up call raised; `said` holds what Mooncake printed meanwhile."""

    def __init__(self, cause: BaseException, said: list[str]) -> None:
        super().__init__(str(cause))
        self.cause, self.said = cause, said


def initialize_quietly(start: Callable[[], T]) -> tuple[T, list[str]]:
    """Run `start()` with stderr captured; return its result and the lines Mooncake printed that
    were not noise (already written back to stderr). Raises StartupFailed for an exception."""
    failure: BaseException | None
    with _captured_stderr() as lines:
        try:
            result = start()
        except BaseException as exc:  # noqa: BLE001 - re-raised with what was said
            failure = exc
        else:
            failure = None
    said = [line for line in lines if line.strip()]
    kept = [line for line in said if not NOISE.search(line)]
    for line in said:
        if NOISE.search(line):
            log.debug("mooncake: %s", line)
    if kept:
        sys.stderr.write("\n".join(kept) + "\n")
        sys.stderr.flush()
    if failure is not None:
        raise StartupFailed(failure, said) from failure
    return result, kept


@contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """The process's file descriptor 2 goes to a temporary file inside the block (C++ writes
    there directly); the list holds its lines once the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    lines: list[str] = []
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines.extend(capture.read().decode(errors="replace").splitlines())
