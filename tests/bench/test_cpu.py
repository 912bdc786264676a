"""The machine's CPU-seconds (`p2psync.bench.cpu`) against this process's own, as the kernel
counts them for it (`time.process_time`): the machine spent at least what this process spent
while it spun, and at most every core's whole time."""

from __future__ import annotations

import os
import time

from p2psync.bench.cpu import machine_seconds

#: One clock tick of /proc/stat's counters, per core.
TICK = 0.01


def test_the_machine_spent_at_least_what_this_process_spent_and_at_most_all_its_cores():
    wall, own, machine = time.monotonic(), time.process_time(), machine_seconds()
    while time.process_time() - own < 0.3:
        pass
    spent_here, spent, took = time.process_time() - own, machine_seconds() - machine, time.monotonic() - wall
    cores = os.cpu_count() or 1
    assert spent_here - TICK * cores <= spent <= took * cores + TICK * cores, (spent_here, spent, took)
