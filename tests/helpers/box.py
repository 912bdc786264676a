"""Running a script in the cluster in a box, for the tests of `p2psync.worlds.netbox`.

The box needs root (a network namespace of its own), iproute2 and, for latency, iptables:
without them the test is skipped, naming what is missing. Anything else that goes wrong in the script fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


#: The box's tools, and the Debian package of each.
PACKAGES = {"ip": "iproute2", "tc": "iproute2", "iptables-legacy": "iptables"}


def unavailable(tools: Sequence[str] = ("ip", "tc")) -> str:
    """Why the box cannot be made here ("" where it can)."""
    if os.geteuid() != 0:
        return "the cluster in a box needs root: a network namespace of its own (CAP_SYS_ADMIN)"
    for tool in tools:
        if not any(os.access(f"{d}/{tool}", os.X_OK) for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            return f"the cluster in a box needs `{tool}` (apt-get install {PACKAGES[tool]})"
    return ""


class BoxRun:
    """`script` (which enters the box itself) running in a fresh interpreter, started now."""

    def __init__(self, script: Path, args: Sequence[str] = (), *, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=script.parent,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "UCX_NET_DEVICES": "lo",
                 **(env or {})},
        )

    def result(self, timeout: float) -> dict:
        """Its last line of output, as JSON, once it ended well within `timeout`."""
        try:
            stdout, stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert self.process.returncode == 0, stderr[-4000:]
        return json.loads(stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def run_in_box(script: Path, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
               timeout: float = 240, tools: Sequence[str] = ("ip", "tc")) -> dict:
    """Run `script` (which enters the box itself, using `tools`) in a fresh interpreter; its
    last line of output, as JSON."""
    if why := unavailable(tools):
        pytest.skip(why)
    return BoxRun(script, args, env=env).result(timeout)
