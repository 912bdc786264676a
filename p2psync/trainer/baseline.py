"""Baselines of delta updates: per layout unit (layout key and rank) a sender produces, the
bytes it produced in the last update and that update's number (the session's own
count: users may reuse version names).

A unit's baseline mirrors how its groups sit in the transfer buffers: each group
(a gathered `ParamGroup`, or a rank's gather-free packing of one: `PackedSlot`) has a
slot of its aligned size, and a region of a group's bytes has the same offset in
the slot as in the buffer. Baselines live in host memory, pinned when the
transfer buffers are on a device (they are copied there to be compared), and are
allocated at the first update, unit by unit in sending order, while they fit the
memory budget; a unit that does not fit has none, and its targets always get full
updates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..core.layout import aligned

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Slotted(Protocol):
    """What a baseline keeps a slot of: equal keys mean the same target bytes, in the same order."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class _Baseline:
    slots: dict[Slotted, int]
    nbytes: int
    data: torch.Tensor | None = None
    #: The update whose bytes `data` holds in full; None while unknown or being overwritten.
    update: int | None = None
    #: Whether producing this unit failed in the update under way (its slots may be half new).
    broken: bool = False


@dataclass
class BaselineStore:
    """The baselines of the units one sender produces, within `budget` bytes (None: no bound)."""

    budget: int | None = None
    pin_memory: bool = False
    _units: dict[str, _Baseline] = field(default_factory=dict)

    def configure(self, units: Mapping[str, Sequence[Slotted]]) -> None:
        """The units this sender produces now, each with its groups in sending order. A
        unit whose groups are unchanged keeps its baseline; the others start empty."""
        kept: dict[str, _Baseline] = {}
        for unit, groups in units.items():
            slots, offset = {}, 0
            for group in groups:
                slots[group] = offset
                offset += aligned(group.nbytes)
            old = self._units.get(unit)
            kept[unit] = old if old is not None and old.slots == slots else _Baseline(slots, offset)
        self._units = kept

    @property
    def held_bytes(self) -> int:
        """Host memory the baselines hold."""
        return sum(b.data.numel() for b in self._units.values() if b.data is not None)

    def update_of(self, unit: str) -> int | None:
        """The update whose bytes the unit's baseline holds, or None."""
        baseline = self._units.get(unit)
        return None if baseline is None else baseline.update

    def start_update(self) -> list[str]:
        """Allocate the baselines that fit the budget and mark every one as being overwritten;
        the units left without one (always sent in full)."""
        import torch

        held = self.held_bytes
        left_out = []
        for unit, baseline in self._units.items():
            if baseline.data is None:
                if self.budget is not None and held + baseline.nbytes > self.budget:
                    left_out.append(unit)
                    continue
                baseline.data = torch.empty(max(baseline.nbytes, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
                held += baseline.nbytes
            baseline.update, baseline.broken = None, False
        if left_out:
            log.warning(
                "delta baselines: %d unit(s) do not fit the %d-byte budget and are always sent in full: %s",
                len(left_out), self.budget, ", ".join(left_out),
            )
        return left_out

    def slot(self, unit: str, group: Slotted) -> torch.Tensor | None:
        """The baseline bytes of `group` (its slot, `group.nbytes` long), or None if the unit has none."""
        baseline = self._units[unit]
        if baseline.data is None:
            return None
        start = baseline.slots[group]
        return baseline.data[start : start + group.nbytes]

    def break_unit(self, unit: str) -> None:
        """Producing the unit failed: its baseline (if it has one here) holds no whole update
        after this one."""
        if unit in self._units:
            self._units[unit].broken = True

    def seal(self, update: int) -> None:
        """Every unit produced whole in this update now holds update number `update`."""
        for baseline in self._units.values():
            if baseline.data is not None and not baseline.broken:
                baseline.update = update
