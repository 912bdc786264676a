"""What an engine rank holds and whether it may serve: the one place an endpoint keeps it.

An engine serves only weights of a known version: from the start, only if its user
declared the version it loaded; otherwise from its first update on. An update holds
a lease: paused for version X, the engine expects the trainer to finish (or renew)
within the lease; if it does not, the update is abandoned, the engine marks itself
stale and stays out of serving until a later update finishes. An update the trainer
gave up on (`fail`) is final: its finish is refused should it still come, and undone if it
came already (a finish whose answer the trainer never got), so that the trainer's report is
the truth. A successor that replaces the engine (a higher incarnation) retires it for good.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..core.control import Refused


@dataclass
class EngineState:
    """Version held, update in progress and its lease, stale mark. Not thread-safe: the
    endpoint guards it with its lock. Times are `time.monotonic()` seconds."""

    version: str | None = None
    #: Version of the update in progress (paused for it), if any.
    updating: str | None = None
    #: When the update's lease runs out, and its length (renewals extend it by that much).
    lease_until: float | None = None
    lease: float = 0.0
    #: Why the engine does not serve its weights (abandoned update, replaced), if it is stale.
    stale: str | None = None
    #: The version of the update the trainer gave up on, until the next pause.
    given_up: str | None = None
    retired: bool = False
    #: When the last update finished here (`time.time()`, for people reading a status), if one did.
    finished_at: float | None = None
    #: Updates finished here, and how often the engine went stale (counters for its metrics).
    updates: int = 0
    stale_marks: int = 0
    #: When the update in progress paused the engine, and how long the last one held it paused.
    paused_at: float | None = None
    last_update_seconds: float | None = None

    @property
    def serving(self) -> bool:
        return self.version is not None and self.updating is None and self.stale is None

    def why_not_serving(self) -> str:
        if self.stale is not None:
            return self.stale
        if self.updating is not None:
            return f"it is being updated to version {self.updating!r}"
        return "it holds weights of no known version (waiting for its first update)"

    def begin(self, version: str, lease: float, now: float) -> bool:
        """Pause for an update to `version`; True if the engine was serving until now."""
        self._refuse_if_retired()
        was_serving = self.serving
        self.updating, self.lease, self.lease_until, self.given_up = version, lease, now + lease, None
        self.paused_at = now
        return was_serving

    def renew(self, version: str, now: float) -> None:
        if self.updating != version:
            raise Refused(f"lease renewal for version {version!r}, but {self._in_progress()}")
        self.lease_until = now + self.lease

    def check_update(self, version: str, call: str) -> None:
        """Refuse a `call` (finish, patch) that is not part of the update in progress, or is
        part of one the trainer gave up on."""
        self._refuse_if_retired()
        if self.updating != version:
            raise Refused(f"{call} of version {version!r}, but {self._in_progress()}")
        if self.given_up == version:
            raise Refused(f"{call} of version {version!r}, which the trainer gave up on: {self.stale}")

    def complete(self, version: str) -> None:
        """Every write of the update to `version` landed: hold it and serve again. Also
        after the lease ran out (the bytes are whole, the update only came late), unless the
        trainer gave it up."""
        self.check_update(version, "finish")
        self.version, self.updating, self.lease_until, self.stale = version, None, None, None
        self.finished_at, self.updates = time.time(), self.updates + 1
        if self.paused_at is not None:
            self.last_update_seconds = time.monotonic() - self.paused_at

    def expire(self, now: float) -> str | None:
        """Mark the update abandoned if its lease ran out by `now`; the reason if it did just now."""
        if self.lease_until is None or now < self.lease_until or self.stale is not None:
            return None
        self.lease_until = None
        return self._mark_stale(
            f"update abandoned at version {self.updating!r} (was serving {self.version!r}): no finish within "
            f"{self.lease:g} s of its start or last renewal; its weights may be mixed"
        )

    def fail(self, version: str, reason: str) -> tuple[str, bool]:
        """The trainer gave up on the update to `version` (`reason`: a failed check, failed
        writes, a finish that got no answer): stale at once, not serving until a later update
        finishes, also where that update finished here already. The stale mark, and whether
        the engine was serving until now."""
        self._refuse_if_retired()
        finished = self.updating is None and self.version == version
        if self.updating != version and not finished:
            raise Refused(f"fail of version {version!r}, but {self._in_progress()}")
        was_serving = self.serving
        held = "after it finished here" if finished else f"(was serving {self.version!r})"
        self.given_up, self.lease_until = version, None
        return self._mark_stale(f"update {version!r} given up by the trainer {held}: {reason}"), was_serving

    def altered(self, reason: str) -> bool:
        """Its weights changed outside an update (a write its transport could not refuse): stale
        until a later update finishes. True if the engine was serving until now."""
        was_serving = self.serving
        self._mark_stale(reason)
        return was_serving

    def retire(self, reason: str) -> bool:
        """Replaced for good by a successor; True if the engine was serving until now."""
        was_serving = self.serving
        self.retired, self.updating, self.lease_until = True, None, None
        self._mark_stale(reason)
        return was_serving

    def _mark_stale(self, reason: str) -> str:
        """Out of serving for `reason` until a later update finishes; counted for the metrics."""
        self.stale, self.stale_marks = reason, self.stale_marks + 1
        return reason

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version, "updating": self.updating, "serving": self.serving, "stale": self.stale,
            "finished_at": self.finished_at,
        }

    def _in_progress(self) -> str:
        return f"the update in progress is to {self.updating!r}" if self.updating else "no update is in progress"

    def _refuse_if_retired(self) -> None:
        if self.retired:
            raise Refused(f"this engine rank is no longer served here: {self.stale}")
