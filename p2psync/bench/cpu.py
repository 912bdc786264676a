"""CPU-seconds the whole machine spent, from /proc/stat: what a step of the bench cost the
cores, whichever process or thread spent them (trainer and engine ranks, gloo's and the
transports' threads, the kernel's TCP work on both ends of every loopback byte). On a quiet
machine that is the bench's own: the load average beside each run says how quiet it was.
Set beside a step's seconds, it tells whether the cores or the way's own waits bound it."""

from __future__ import annotations

import os

#: /proc/stat's busy columns on the "cpu" line: user, nice, system, irq, softirq (not idle,
#: iowait, or steal, the time a hypervisor gave to others).
BUSY_COLUMNS = (0, 1, 2, 5, 6)


def machine_seconds() -> float:
    """CPU-seconds every core of the machine has been busy since boot."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    if fields[0] != "cpu":
        raise RuntimeError(f"/proc/stat does not start with the machine's cpu line: {fields[:1]}")
    ticks = [int(v) for v in fields[1:]]
    return sum(ticks[i] for i in BUSY_COLUMNS) / os.sysconf("SC_CLK_TCK")
