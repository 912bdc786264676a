"""How an update chooses what each target receives: every byte (`FullUpdates`), or only
what changed since the bytes it holds (`DeltaUpdates`, over `delta_send.DeltaSender`).

The update run asks its mode the same questions either way, so no step of it branches
on delta mode: which targets get a delta, what of a produced group goes as plain writes,
which patches are staged to write, and what a finished update means for the baselines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..core.delta import PatchRecord
from ..core.types import Region, TargetId, TargetTable
from .baseline import Slotted
from .buffers import BufferPool
from .delta_send import DeltaSender, Held, Served, Share, StagedPatch
from .options import DeltaOptions

if TYPE_CHECKING:
    import torch

    from ..core.report import PhaseClock, UpdateReport
    from ..core.transport import Transport


class FullUpdates:
    """Every target gets every byte of every update."""

    baseline_bytes = 0
    patch_buffer_bytes = 0
    proves_baselines = False  # nothing rests on what an engine held before

    def pool_for(
        self, served: Served, share: Share, current: BufferPool | None, transport: Transport
    ) -> BufferPool | None:
        return None

    def connect(
        self, tables: Mapping[str, Sequence[TargetTable]], served: Served, share: Share, pool: BufferPool | None
    ) -> None:
        pass

    def begin(self, full: bool, version: str, clock: PhaseClock, held: Held) -> None:
        pass

    def is_delta(self, unit: str, target: TargetId) -> bool:
        return False

    def produced(
        self, unit: str, group: Slotted, out: torch.Tensor, written: list[Region], offset: int
    ) -> list[Region]:
        """The regions of a produced group that delta targets get as plain writes: none."""
        return []

    def ready(self) -> list[StagedPatch]:
        return []

    def targets_of(self, patch: StagedPatch) -> list[TargetTable]:
        return []

    def placed(self, patch: StagedPatch, table: TargetTable) -> tuple[int, list[PatchRecord]]:
        raise AssertionError("full updates stage no patches")

    def flush(self) -> None:
        pass

    def unit_failed(self, unit: str) -> None:
        pass

    def finish(self, report: UpdateReport) -> None:
        pass

    def close(self) -> None:
        pass


class DeltaUpdates:
    """A target that holds its unit's baseline gets only what changed: dense chunks as plain
    writes, sparse ones as patches its engine applies (see `delta_send`)."""

    def __init__(self, sender: DeltaSender) -> None:
        self.sender = sender
        self._clock: PhaseClock | None = None

    @property
    def proves_baselines(self) -> bool:
        """Patches rest on the engines holding their baselines: ask them first."""
        return self.sender.options.prove_baselines

    @property
    def baseline_bytes(self) -> int:
        return self.sender.store.held_bytes

    @property
    def patch_buffer_bytes(self) -> int:
        return self.sender.buffer_bytes

    def pool_for(
        self, served: Served, share: Share, current: BufferPool | None, transport: Transport
    ) -> BufferPool | None:
        return self.sender.pool_for(served, share, current, transport)

    def connect(
        self, tables: Mapping[str, Sequence[TargetTable]], served: Served, share: Share, pool: BufferPool | None
    ) -> None:
        self.sender.connect(tables, served, share, pool)

    def begin(self, full: bool, version: str, clock: PhaseClock, held: Held) -> None:
        """Decide the delta targets of the update to `version`, given what the engines say
        they `held` (see `UpdateCalls.held`)."""
        self._clock = clock
        self.sender.begin(full, version, held)

    def is_delta(self, unit: str, target: TargetId) -> bool:
        return self.sender.is_delta(unit, target)

    def produced(
        self, unit: str, group: Slotted, out: torch.Tensor, written: list[Region], offset: int
    ) -> list[Region]:
        """Compare a gathered group, or this rank's packing of a gather-free one, with its
        baseline (the time is the clock's `delta` phase)."""
        assert self._clock is not None, "begin() first"
        self._clock.lap("produce")
        dense = self.sender.diff(unit, group, out, written, offset)
        self._clock.lap("delta")
        return dense

    def ready(self) -> list[StagedPatch]:
        return self.sender.ready()

    def targets_of(self, patch: StagedPatch) -> list[TargetTable]:
        return self.sender.targets_of(patch)

    def placed(self, patch: StagedPatch, table: TargetTable) -> tuple[int, list[PatchRecord]]:
        return self.sender.placed(patch, table)

    def flush(self) -> None:
        self.sender.flush()

    def unit_failed(self, unit: str) -> None:
        self.sender.unit_failed(unit)

    def finish(self, report: UpdateReport) -> None:
        self.sender.finish(report)

    def close(self) -> None:
        self.sender.close()


UpdateMode = FullUpdates | DeltaUpdates


def mode_for(
    options: DeltaOptions | None, *, device: str, pin_memory: bool, timeout: float, on_stall: Callable[[float], None]
) -> UpdateMode:
    """The update mode `options` ask for (None: full updates)."""
    if options is None:
        return FullUpdates()
    return DeltaUpdates(
        DeltaSender(options, device=device, pin_memory=pin_memory, acquire_timeout=timeout, on_stall=on_stall)
    )
