"""p2psync's own version: part of every key under which something p2psync built is kept.

The version alone is the same at every commit, so what is kept from a compile (the layout
cache) is also keyed by a hash of the sources that decide it (`layout_build`,
`source_hash`): another build never reads what this one wrote.
"""

from __future__ import annotations

import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    VERSION = version("p2psync")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"

#: p2psync's sources (relative to the package) that decide a compiled layout's bytes.
LAYOUT_SOURCES = ("layouts", "core/layout.py", "core/types.py")


@functools.cache
def source_hash(*paths: str) -> str:
    """SHA-256 (16 hex digits) of the Python sources at `paths` (files, or directories with
    everything under them), names and bytes; read once per process."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            data = file.read_bytes()
            digest.update(f"{file.relative_to(path)}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def layout_build() -> str:
    """p2psync's version and the hash of its `LAYOUT_SOURCES`: changes with every build that
    could compile a layout differently."""
    package = Path(__file__).parents[1]
    return f"{VERSION}+{source_hash(*(str(package / p) for p in LAYOUT_SOURCES))}"
