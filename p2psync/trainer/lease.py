"""The trainer's side of the engines' update leases.

An engine paused for an update waits `lease` seconds for the trainer to finish or to
renew; past that it abandons the update and marks itself stale (see `EngineState`).
World rank 0 pauses the engines and renews their leases as buckets go by, so that a
long update of a large model never looks abandoned while a trainer that died, or a
world whose collectives hang, stops renewing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from ..core.engine import EngineControl
from ..core.errors import ControlError

log = logging.getLogger(__name__)


class UpdateLease:
    """Pauses `controls`' engines for the update to `version` and renews their leases at
    most every quarter `lease`."""

    def __init__(self, controls: Mapping[str, EngineControl], version: str, lease: float) -> None:
        self.controls = controls
        self.version = version
        self.lease = lease
        self._renewed = time.monotonic()

    def pause_all(self) -> dict[str, str]:
        """Pause every engine; the ones that refused, with why."""
        failed = {}
        for engine, control in self.controls.items():
            try:
                control.pause(self.version, self.lease)
            except ControlError as exc:
                failed[engine] = f"pause failed: {exc}"
        self._renewed = time.monotonic()
        return failed

    def progressed(self, failed: Mapping[str, str]) -> None:
        """The update made progress: renew the leases of the engines not failed, if due."""
        now = time.monotonic()
        if now - self._renewed < self.lease / 4:
            return
        self._renewed = now
        for engine, control in self.controls.items():
            if engine in failed:
                continue
            try:
                control.renew(self.version)
            except ControlError as exc:  # its writes or its finish will say what is wrong
                log.warning("renewing the update lease of engine %s failed: %s", engine, exc)
