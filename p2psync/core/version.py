"""p2psync's own version: part of every key under which something p2psync built is kept."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("p2psync")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"
