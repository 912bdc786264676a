"""A trainer rank's own failure during an update, carried to every other rank at once.

An exception from this rank's own code (the caller's `progress`, a source's local
shards, the delta mode) must not leave the other ranks waiting in the update's next
collective for as long as this process lives, and then call it lost. The failing rank
stops its own work, posts the failure in the rendezvous (the others skip the rest of
their own work at their next step), still takes part in every collective the others are
in (the remaining gathers, the final all-gather, which carries its exception text), and
every rank then raises the same `TrainerRankFailed`. An exception inside a collective is
another matter: the world is broken, and liveness names the ranks that were lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from ..core.errors import TrainerRankFailed, first_line

if TYPE_CHECKING:
    from ..core.rendezvous import Rendezvous

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two looks at the rendezvous for another rank's failure.
POLL = 0.2


class RankFailures:
    """This rank's failure in update `key` (one per update of a session), and whether another
    rank posted one."""

    def __init__(self, rendezvous: Rendezvous | None, rank: int, key: str, *, poll: float = POLL) -> None:
        self.rank = rank
        self.error: str | None = None  # this rank's, as "Type: message"
        self.exception: BaseException | None = None
        self._rendezvous, self._key, self._poll = rendezvous, key, poll
        self._others = False
        self._looked = 0.0

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run one step of this rank's own work; an exception there is this rank's failure."""
        try:
            yield
        except Exception as exc:
            self.fail(what, exc)

    def run(self, what: str, step: Callable[[], T]) -> T | None:
        """`step()`, or None once this update failed anywhere (then `step` does not run)."""
        if self.stopping():
            return None
        with self.guard(what):
            return step()
        return None

    def fail(self, what: str, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error, self.exception = f"{type(exc).__name__} in {what}: {first_line(exc)}", exc
        log.error("update failed on this rank: %s", self.error, exc_info=exc)
        if self._rendezvous is not None:
            try:
                self._rendezvous.add(self._key, 1)
            except Exception:  # the others still learn it at the final all-gather
                log.warning("could not post this rank's failure in the rendezvous", exc_info=True)

    def stopping(self) -> bool:
        """Whether this update failed here or, as last seen (every `poll` seconds), elsewhere."""
        if self.error is not None or self._others:
            return True
        now = time.monotonic()
        if self._rendezvous is not None and now - self._looked >= self._poll:
            self._looked = now
            try:
                self._others = self._rendezvous.add(self._key, 0) > 0
            except Exception:  # a lost rendezvous shows in the collectives
                pass
        return self._others

    def raise_any(self, version: str, errors: Mapping[int, str | None]) -> None:
        """Raise `TrainerRankFailed` if any rank's entry of `errors` names a failure."""
        failures = {rank: error for rank, error in errors.items() if error}
        if not failures:
            return
        ranks = ", ".join(f"rank {rank}: {error}" for rank, error in sorted(failures.items()))
        raise TrainerRankFailed(f"update {version!r} failed on trainer {ranks}", failures) from self.exception
