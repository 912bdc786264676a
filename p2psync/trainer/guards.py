"""What a session refuses before an update starts: a second call while one runs (from
another thread of the same rank), and version labels that would name two sets of weights."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..core.errors import ConcurrentCallError, VersionError


class OneCallAtATime:
    """Lets one `connect` or `update` run at a time; a concurrent one raises at once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._running: str | None = None

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentCallError(
                f"trainer rank {self.rank}: {what} called while {self._running} is running on this Session "
                "in another thread; a Session takes one call at a time"
            )
        self._running = what
        try:
            yield
        finally:
            self._running = None
            self._lock.release()


def _natural(label: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A label's text parts and its numbers ("step-10" -> (("step-",), (10,)))."""
    parts = re.split(r"(\d+)", label)
    return tuple(parts[0::2]), tuple(int(n) for n in parts[1::2])


class VersionLabels:
    """The labels of a session's updates. A label may name one set of weights only: a label
    used before, or one that orders before the latest (where both read as the same text
    with other numbers: "v9" then "v10" is forward, "v10" then "v3" backwards), is refused
    unless the caller says it is a rollback."""

    def __init__(self) -> None:
        self._used: dict[str, int] = {}  # label -> the update that used it
        self._latest: str | None = None
        self._count = 0

    def check(self, version: str, *, rollback: bool) -> None:
        if not isinstance(version, str) or not version:
            raise VersionError(f"a version label must be a non-empty string, got {version!r}")
        if rollback:
            return
        if version in self._used:
            raise VersionError(
                f"version {version!r} was already used by update {self._used[version] + 1} of this session; "
                "a label names one set of weights (pass rollback=True to go back to those weights on purpose)"
            )
        latest = self._latest
        if latest is not None:
            (text, numbers), (latest_text, latest_numbers) = _natural(version), _natural(latest)
            if text == latest_text and numbers < latest_numbers:
                raise VersionError(
                    f"version {version!r} orders before the latest update's {latest!r}; "
                    "pass rollback=True to go back on purpose"
                )

    def record(self, version: str) -> None:
        self._used.setdefault(version, self._count)
        self._latest = version
        self._count += 1
