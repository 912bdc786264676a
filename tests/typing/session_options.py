"""Checked by mypy (tox -e typecheck: pyproject's `files`), never run: Session's option keywords
are typed. Each `type: ignore` below marks an error mypy must report; were it not reported
(the keywords untyped again), `warn_unused_ignores` fails the check."""

from __future__ import annotations

from p2psync.core.rendezvous import Rendezvous
from p2psync.core.source import TrainerSource
from p2psync.trainer.session import Session


def sessions(source: TrainerSource, rendezvous: Rendezvous) -> None:
    Session(source=source, rendezvous=rendezvous, transport="mooncake", check=True, gather="always")
    Session(source=source, rendezvous=rendezvous, transport="mooncake", chek=True)  # type: ignore[call-arg]
    Session(source=source, rendezvous=rendezvous, transport="mooncake", gather="sometimes")  # type: ignore[arg-type]
    Session(source=source, rendezvous=rendezvous, transport="mooncake", bucket_bytes="64M")  # type: ignore[arg-type]
