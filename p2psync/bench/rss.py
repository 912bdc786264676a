"""Resident memory of this process, from Linux's /proc: now, and the peak since a reset.

`ru_maxrss` only ever grows, so a peak reached while connecting (a copy map's
probes) would hide what an update adds; writing 5 to clear_refs restarts the peak
(VmHWM) from the current resident size.

glibc keeps freed small blocks in its heap, resident: after one step, the next one
reuses those pages without adding RSS, and the first step of a run looks costlier than
the rest (measured: p2psync's first sglang update left 31 MB of main heap resident, all
of it free: `malloc_trim` returned it). So `reset_peak` first hands free heap pages back,
and every step's peak counts everything it touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _status(field: str) -> int:
    """A `/proc/self/status` field in bytes (the kernel reports kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Return free heap pages to the system, restart the peak from now; return the resident bytes now."""
    trim()
    Path("/proc/self/clear_refs").write_text("5")
    return now()


def trim() -> None:
    """Hand glibc's free heap pages back to the system (`malloc_trim(0)`); no effect elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def now() -> int:
    """The resident bytes now."""
    return _status("VmRSS")


def peak() -> int:
    """The most resident bytes since the last `reset_peak`."""
    return _status("VmHWM")


def return_freed_memory() -> None:
    """Make freed tensors leave RSS. glibc serves blocks below its mmap threshold from the
    heap and raises that threshold (to 32 MiB) as large blocks are freed, so freed
    buckets stay resident and RSS counts what malloc keeps besides what is live. A
    fixed 1 MiB threshold gives every larger tensor its own mapping, unmapped on free.
    No effect where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 1 << 20)
