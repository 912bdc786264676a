"""The address this process's servers bind and publish to their peers."""

from __future__ import annotations

import os

#: Names it: unset, loopback; in the cluster in a box, the process's emulated node address.
HOST_ENV = "P2PSYNC_HOST"


def local_host() -> str:
    """$P2PSYNC_HOST, or 127.0.0.1."""
    return os.environ.get(HOST_ENV) or "127.0.0.1"
