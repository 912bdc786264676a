"""Keeping an engine rank's table in the rendezvous while rendezvous and trainers come and go.

Engines outlive trainers. Where the rendezvous lived in a trainer process (trainer rank 0's
store, the one-machine default) and that process ends, the store goes with it and a
restarted trainer world starts an empty one at the job's address. `Presence` looks every
few seconds: while the store does not answer, the engine keeps serving its last version and
waits (saying so once); when a store answers that does not hold the rank's table, the table
is published again, so that the new trainer world finds it. A place held by another
process means this rank was replaced: the watch ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..core.errors import RendezvousError, where
from ..core.rendezvous import Rendezvous
from ..core.types import TargetTable

log = logging.getLogger(__name__)

#: Seconds between two looks at the rendezvous.
EVERY = 2.0


class Presence:
    """Watches one rank's place in the rendezvous at `rendezvous`'s address (with a client of
    its own: the endpoint's may be in use by another thread) and publishes `table()` again
    where a new store lacks it."""

    def __init__(self, rendezvous: Rendezvous, table: Callable[[], TargetTable | None], every: float = EVERY) -> None:
        self._rendezvous = Rendezvous(  # the store's keys only: it needs no token
            host=rendezvous.host, port=rendezvous.port, job_id=rendezvous.job_id, timeout=rendezvous.timeout
        )
        self._table = table
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2psync-presence", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 10)

    def _run(self) -> None:
        gone = False
        while not self._stop.wait(self.every):
            table = self._table()
            if table is None:
                continue
            try:
                held = self._rendezvous.held(table.engine_id, table.rank, timeout=self.every)
                if held is None:
                    self._publish_again(table)
                elif held.instance != table.instance:
                    log.info("%s: its place is held by %s now; no longer kept", _where(table), held.instance)
                    return
            except RendezvousError as exc:
                if not gone:
                    log.warning("%s: the rendezvous does not answer (%s); serving on, waiting for it to return",
                                _where(table), exc)
                gone = True
                self._rendezvous.reset()
                continue
            gone = False

    def _publish_again(self, table: TargetTable) -> None:
        if self._rendezvous.publish(table) is None:
            log.info("%s: published again to the rendezvous at %s (a new store)", _where(table), self._rendezvous.where)


def _where(table: TargetTable) -> str:
    return where(table.engine_id, table.rank)
