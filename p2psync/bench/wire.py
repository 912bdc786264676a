"""Bytes that threads of this process wrote, from Linux's per-thread I/O counters.

gloo's TCP pairs send with `writev`, which `/proc/<pid>/task/<tid>/io` counts in `wchar`
per thread; a gloo process group does its I/O on the threads it starts when it is made
(its event loop and workers). So the bytes one group sent are measured by counting the
writes of exactly those threads. (Its receives use calls that `rchar` does not count, and
Mooncake's threads send with calls that `wchar` does not count: p2psync's bytes are counted
by its writers instead.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _written(tid: int) -> int:
    try:
        text = Path(f"/proc/self/task/{tid}/io").read_text()
    except OSError:  # the thread has ended
        return 0
    for line in text.splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class ThreadBytes:
    """The threads that one call started, and the bytes they have written since."""

    def __init__(self, tids: set[int]) -> None:
        self.tids = tids

    @classmethod
    def started_by(cls, make: Callable[[], T]) -> tuple[T, ThreadBytes]:
        """Call `make`; return its result and the threads it started."""
        before = _threads()
        result = make()
        return result, cls(_threads() - before)

    def written(self) -> int:
        """Bytes the threads have written so far (a counter: take differences)."""
        return sum(_written(tid) for tid in self.tids)
