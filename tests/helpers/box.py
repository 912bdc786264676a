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


def run_in_box(script: Path, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
               timeout: float = 240, tools: Sequence[str] = ("ip", "tc")) -> dict:
    """Run `script` (which enters the box itself, using `tools`) in a fresh interpreter; its
    last line of output, as JSON."""
    if os.geteuid() != 0:
        pytest.skip("the cluster in a box needs root: a network namespace of its own (CAP_SYS_ADMIN)")
    for tool in tools:
        if not any(os.access(f"{d}/{tool}", os.X_OK) for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            pytest.skip(f"the cluster in a box needs `{tool}` (apt-get install {PACKAGES[tool]})")
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=script.parent,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "UCX_NET_DEVICES": "lo", **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
