"""Compiled layouts on disk (`SessionOptions.layout_cache_dir`, default `$P2PSYNC_CACHE_DIR`),
so that a trainer process that starts again (after a restart from a checkpoint, or a new job
on the same engines) reads its layouts instead of compiling them.

One file per layout key, under the key's SHA-256: a magic line, a JSON header line (format,
p2psync version, the full key, the payload's size and SHA-256), then the payload
(`layouts.stored`). The key names everything that decides the layout, the builds of
p2psync and of the engine adapter included (`trainer.layouts.LayoutCache._key`), so
another build never reads this one's entries. The directory may be shared by every rank
and process of a job, and by jobs: an entry is written to a temporary file beside it and
renamed into place (atomic; of concurrent writers of one key, the last rename wins, with
equal bytes). Nothing read is trusted: a missing magic, another format or version, another
key (an entry renamed into place), a short or corrupt payload, one that does not decode,
or one that `decode` refuses (the layout cache checks each against the engine's own
loader: `p2psync.layouts.verify`) is logged once as a WARNING naming the file, removed,
and compiled again (which writes it anew).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..core.version import VERSION

log = logging.getLogger(__name__)

MAGIC = b"p2psync-layout\n"
#: The format of an entry around its payload (the payload's own: `layouts.stored.FORMAT`).
FORMAT = 1
T = TypeVar("T")


class LayoutDisk:
    """The layout entries under `directory`/layouts."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory) / "layouts"

    def path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.layout"

    def load(self, key: str, decode: Callable[[bytes], T]) -> T | None:
        """`decode` of the payload stored under `key`; None where there is none or it is not
        trusted (then removed, with a warning naming the file)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("layout cache entry %s cannot be read (%s); compiling the layout", path, exc)
            return None
        try:
            return decode(_payload(data, key))
        except Exception as exc:  # noqa: BLE001 - a bad entry is compiled again, whatever it holds
            log.warning("layout cache entry %s is not used: %s; removing it and compiling the layout again", path, exc)
            with contextlib.suppress(OSError):  # gone already (another rank), or a read-only directory
                path.unlink()
            return None

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def store(self, key: str, payload: bytes) -> None:
        """Write `payload` under `key` atomically; a failure is a warning (the layout is in memory)."""
        path = self.path(key)
        header = {
            "format": FORMAT, "p2psync": VERSION, "key": key,
            "nbytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
        }
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem[:16]}-", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload)
            os.chmod(tmp, 0o644)  # readable by every rank's user, as the directory allows
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("layout cache entry %s could not be written (%s); the layout is kept in memory only", path, exc)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


class Untrusted(ValueError):
    """An entry that does not hold the layout of the key it is read for."""


def _payload(data: bytes, key: str) -> bytes:
    """The payload of entry `data`, if it holds the layout of `key`; else Untrusted says why."""
    if not data.startswith(MAGIC):
        raise Untrusted("it is not a p2psync layout entry")
    parts = data.split(b"\n", 2)
    if len(parts) < 3:
        raise Untrusted("it is truncated (no header)")
    try:
        header = json.loads(parts[1])
        fmt, version, stored_key = header["format"], header["p2psync"], header["key"]
        nbytes, digest = header["nbytes"], header["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise Untrusted(f"its header does not parse ({type(exc).__name__}: {exc})") from None
    if (fmt, version) != (FORMAT, VERSION):
        raise Untrusted(f"written in format {fmt!r} by p2psync {version!r}; this is format {FORMAT} of p2psync {VERSION!r}")
    if stored_key != key:
        raise Untrusted("it holds the layout of another key")
    payload = parts[2]
    if len(payload) != nbytes:
        raise Untrusted(f"its payload is {len(payload)} bytes, the header says {nbytes} (truncated)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise Untrusted("its payload does not match its SHA-256 (corrupt)")
    return payload
