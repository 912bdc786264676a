"""The job's secret token: engines refuse control calls without it.

It comes from the job, never from the rendezvous (whatever a rendezvous holds, any
process that reaches it may read). In order:

1. `$P2PSYNC_TOKEN`, where the launcher sets it in every process of the job;
2. `$P2PSYNC_TOKEN_FILE`, a file the launcher wrote (its first line);
3. under Ray, the job's rendezvous actor (`p2psync.adapters.ray`), which sets
   `$P2PSYNC_TOKEN` in the processes it serves;
4. on one machine, a per-user file under `$P2PSYNC_TOKEN_DIR` (default
   `~/.cache/p2psync/tokens`), one per job id, made (mode 0600) by whichever process of the
   job needs it first: every process of that user on this host reads the same token, and a
   trainer that starts again keeps it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_ENV = "P2PSYNC_TOKEN"
TOKEN_FILE_ENV = "P2PSYNC_TOKEN_FILE"
TOKEN_DIR_ENV = "P2PSYNC_TOKEN_DIR"


def job_token(job_id: str) -> str:
    """The token of job `job_id` (see the module's docstring)."""
    named = os.environ.get(TOKEN_ENV)
    if named:
        return named
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        token = _read(Path(path))
        if not token:
            raise ValueError(f"${TOKEN_FILE_ENV} names {path}, which holds no token")
        return token
    return _host_token(job_id)


def _token_dir() -> Path:
    return Path(os.environ.get(TOKEN_DIR_ENV) or Path.home() / ".cache" / "p2psync" / "tokens")


def _host_token(job_id: str) -> str:
    """This user's token for `job_id` on this host, made once: written to a private temporary
    file and linked into place, so that of processes racing to make it one wins and all read it."""
    directory = _token_dir()
    path = directory / job_id
    token = _read(path)
    if token:
        return token
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = directory / f".{job_id}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    try:
        os.link(tmp, path)  # fails where another process made it first: its token wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read(path)


def _read(path: Path) -> str:
    try:
        return path.read_text().split("\n", 1)[0].strip()
    except FileNotFoundError:
        return ""
