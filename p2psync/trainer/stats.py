"""What a session can say about its connection and its last update on this rank, in one
snapshot: what the bench, the worlds and tests read instead of the session's insides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .layouts import LayoutCounts

if TYPE_CHECKING:
    from ..core.report import PhaseClock
    from .connection import Connection
    from .modes import UpdateMode


@dataclass(frozen=True)
class SessionStats:
    """One trainer rank's view: sizes known after `connect`, the rest of the last update.

    `buffer_bytes`: the registered transfer buffers (both); `baseline_bytes` and
    `patch_buffer_bytes`: what delta updates hold (their sum is `delta_bytes`); `largest_group_bytes`: the largest parameter
    group this rank produces; `gather_free_bytes`: bytes of one update sent gather-free,
    and produced from gathered tensors (per unit: each goes to every target of its unit);
    `buckets`: the HF tensors of each bucket one update gathers, in order;
    `gather_dtypes`: HF tensors gathered cast to a narrower dtype; `sent_bytes` and
    `write_intervals` ((start, end) on the monotonic clock) of the writes of the last
    update; `phase_seconds`: where the last update spent its time: pause (until world
    rank 0 paused the engines), gather, produce (filling buffers), delta (comparing with
    the baselines and staging patches), buffer_wait (for a buffer that writes still
    held), drain (the last writes), verify, finish (reports and finish calls);
    `layouts`: where the connect's layouts came from (compiled on this rank, from this
    process's memory, from the layout cache directory, from other trainer ranks).
    """

    buffer_bytes: int = 0
    baseline_bytes: int = 0
    patch_buffer_bytes: int = 0
    largest_group_bytes: int = 0
    gather_free_bytes: tuple[int, int] = (0, 0)
    buckets: list[list[str]] = field(default_factory=list)
    gather_dtypes: dict[str, str] = field(default_factory=dict)
    sent_bytes: int = 0
    write_intervals: list[tuple[float, float]] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    layouts: LayoutCounts = field(default_factory=LayoutCounts)

    @property
    def delta_bytes(self) -> int:
        return self.baseline_bytes + self.patch_buffer_bytes

    @property
    def bucket_count(self) -> int:
        return len(self.buckets)


def snapshot(conn: Connection | None, mode: UpdateMode, clock: PhaseClock | None) -> SessionStats:
    """The stats of connection `conn` (None: not connected) in `mode`, its last update's `clock`."""
    baselines, patches = mode.baseline_bytes, mode.patch_buffer_bytes
    if conn is None or conn.compiled is None:
        return SessionStats(baseline_bytes=baselines, patch_buffer_bytes=patches)
    compiled, pool = conn.compiled, conn.pool
    return SessionStats(
        buffer_bytes=pool.nbytes * len(pool.tensors) if pool else 0,
        baseline_bytes=baselines,
        patch_buffer_bytes=patches,
        largest_group_bytes=compiled.largest_group_bytes,
        gather_free_bytes=compiled.gather_free_bytes,
        buckets=[list(names) for names in compiled.buckets],
        gather_dtypes=dict(compiled.gather_dtypes),
        sent_bytes=sum(w.progress.bytes for w in conn.writers.values()),
        write_intervals=sorted(i for w in conn.writers.values() for i in w.progress.intervals),
        phase_seconds=dict(clock.seconds) if clock else {},
        layouts=conn.layout_counts,
    )
