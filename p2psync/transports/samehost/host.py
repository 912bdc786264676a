"""Who and where a process is: enough to refuse a write that would land elsewhere.

A pid means something only on one boot of one host and inside one PID namespace,
and only until that process exits and the pid is reused; the start time in
/proc/<pid>/stat tells a reused pid from the engine that published it.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path
from typing import Any

YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def host_identity() -> dict[str, Any]:
    """This boot of this host, and this process's PID namespace."""
    return {
        "hostname": socket.gethostname(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.stat("/proc/self/ns/pid").st_ino,
    }


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def yama_scope() -> str:
    return YAMA.read_text().strip() if YAMA.exists() else "absent (no Yama LSM)"


def allow_ptrace_writes() -> None:
    """Let other processes of this user write into this one under Yama ptrace_scope 1,
    which otherwise allows it only to ancestors (the trainer is not one).

    Harmless elsewhere: without Yama the call fails and changes nothing; scope 2
    and 3 ignore it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)


def ptrace_advice() -> str:
    """Why a same-user process write may be refused, for EPERM messages."""
    return (
        "the trainer is not allowed to ptrace the engine process: run both as the same user (or give the "
        f"trainer CAP_SYS_PTRACE); Yama ptrace_scope is {yama_scope()} ({YAMA}: 0 and 1 allow it, 1 because "
        "the engine side of this transport calls prctl(PR_SET_PTRACER_ANY), 2 needs CAP_SYS_PTRACE, 3 forbids "
        "it); a container's seccomp profile can forbid process_vm_writev too"
    )
