"""Proof that a rank still holds what the last update left, for delta updates.

A delta patch is computed against the trainer's baseline: the bytes the engine held when
it acknowledged the last update. Anything that wrote the weights since (a user's
`load_state_dict`, a post-load hook that rewrites, a stray write) would leave those
parameters wrong through every later delta. So once a trainer asks (`altered`, at the
start of each delta update), the rank fingerprints every parameter when an update
finishes (on a thread, while it serves again: off the update's path) and compares at the
next update's start, before anything is written; writes it sees itself (its load routes,
the torch engine's `load_state_dict`) are named without hashing. A rank whose bytes
changed is sent its full bytes in that same update.

The fingerprint is blake2b of each parameter's bytes, on the host (a GPU parameter is
copied to host memory first: on GPUs a device-side checksum would be the fast way; not
written, as no GPU runs here).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..core.digest import byte_view, digest

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def fingerprints(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each parameter's fingerprint."""
    return {name: digest(byte_view(t), [(0, t.numel() * t.element_size())]) for name, t in params.items()}


class HeldWeights:
    """What one rank's `params` held when its last update finished, and what wrote them since."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params
        self.asked = False  # a trainer proves deltas against this rank: fingerprint each update
        self._reference: dict[str, str] | None = None
        self._version: str | None = None
        self._written: str | None = None
        self._thread: threading.Thread | None = None

    def written(self, what: str) -> None:
        """Something the engine sees wrote the weights outside p2psync (`what` says what)."""
        self._written = what
        log.warning("weights written outside p2psync (%s): the next delta update sends this rank in full", what)

    def finished(self, version: str) -> None:
        """An update to `version` finished here: fingerprint what it left, on a thread."""
        self.settle()
        self._written = None
        self._reference, self._version = None, version
        if self.asked:
            self._thread = threading.Thread(target=self._fingerprint, name="p2psync-fingerprints", daemon=True)
            self._thread.start()

    def settle(self) -> None:
        """Wait for the fingerprints of the last update (before anything may write)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def altered(self) -> str | None:
        """Why this rank may not hold what the last update left, or None; from now on each
        finished update is fingerprinted."""
        self.asked = True
        self.settle()
        if self._written is not None:
            return f"its weights were written outside p2psync ({self._written}) after update {self._version!r}"
        if self._reference is None:  # not fingerprinted yet: the trainer has no baseline of it either
            return None
        now = fingerprints(self.params)
        changed = [name for name, print_ in now.items() if print_ != self._reference.get(name)]
        if not changed:
            return None
        return (f"{len(changed)} parameter(s) changed since update {self._version!r} other than by p2psync: "
                f"{', '.join(changed)}")

    def _fingerprint(self) -> None:
        self._reference = fingerprints(self.params)
