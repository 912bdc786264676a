"""Which trainer rank was lost: heartbeats in the rendezvous while an update runs.

When a trainer rank dies mid-update, the survivors' next collective fails with the
backend's own words (gloo: "Connection closed by peer"), which name no rank. Each
rank counts up a key of its own in the rendezvous while it is inside `update`; a
survivor whose update failed looks for the ranks whose count stopped.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.rendezvous import Rendezvous

#: Seconds between beats; a rank is lost when its count did not move in `LOST_AFTER` beats.
BEAT = 0.5
LOST_AFTER = 4


class Heartbeat:
    """Beats for trainer rank `rank` (of `world` ranks) from a thread, inside a `with` block."""

    def __init__(self, rendezvous: Rendezvous, rank: int, world: int, *, beat: float = BEAT) -> None:
        self.rank = rank
        self.world = world
        self.beat = beat
        self._rendezvous = rendezvous
        self._beats: Rendezvous | None = None  # a client of its own: beats never wait on the caller's calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"trainer/{rank}/heartbeat"

    def __enter__(self) -> Heartbeat:
        if self.world > 1:
            if self._beats is None:
                self._beats = self._rendezvous.clone()
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, args=(self._beats.store,), name="p2psync-heartbeat", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, store: object) -> None:
        while True:
            try:
                store.add(self._key(self.rank), 1)  # type: ignore[attr-defined]
            except Exception:  # the rendezvous went away: nothing left to tell
                return
            if self._stop.wait(self.beat):
                return

    def lost(self) -> list[int]:
        """The ranks whose beat stopped (this one excepted), watched for `LOST_AFTER` beats."""
        if self.world <= 1:
            return []
        store = self._rendezvous.store
        others = [r for r in range(self.world) if r != self.rank]
        before = {r: store.add(self._key(r), 0) for r in others}
        time.sleep(self.beat * LOST_AFTER)
        return [r for r in others if store.add(self._key(r), 0) == before[r]]
