"""What a world runs and what each of its runs gives back: plain values that the world, its
engine processes and its trainer processes all read, kept apart so that none of them imports
another for its types.

A world's trainer kind is a trainer source's name, or "<source>/<way>" (e.g.
"fsdp2/gather-free", "fsdp2/delta", "fsdp2/gather-free+delta") where its session updates
another way. A plain kind's session gathers every HF tensor (`gather="always"`), so that
the gathering path stays tested beside the default gather-free one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..trainer.options import SessionOptions
from .models import ModelSpec

if TYPE_CHECKING:
    from ..core.report import UpdateReport

#: The session options of a trainer kind's way of updating (see the module's docstring):
#: gather-free is the session's default (`gather="auto"`), so its rows run a session built
#: without a `gather` argument.
SESSION_WAYS: dict[str, dict[str, Any]] = {
    "-": {"gather": "always"}, "gather-free": {}, "delta": {"gather": "always", "delta": True},
    "gather-free+delta": {"delta": True},
}

#: Ranks of a trainer world where its kind fixes them (Megatron-Bridge: TP 2 x PP 2).
TRAINER_RANKS = {"megatron-bridge": 4}


def trainer_kind(source: str, way: str) -> str:
    """The world trainer kind that runs `source` with its session updating `way` (a key of SESSION_WAYS)."""
    return source if way == "-" else f"{source}/{way}"


def split_kind(kind: str) -> tuple[str, str]:
    """A world's trainer kind as (the trainer source, its way of updating: a key of SESSION_WAYS)."""
    source, _, way = kind.partition("/")
    if (way or "-") not in SESSION_WAYS:
        raise ValueError(f"trainer kind {kind!r}: no way {way!r}; the ways are {sorted(SESSION_WAYS)}")
    return source, way or "-"


@dataclass
class WorldOptions:
    """What one world runs. `engines` engines of `engine_tp` ranks each (torch: 1), every
    `(trainer kind, transport)` of `runs` in order, each with `updates` training steps and
    updates, on `trainers` ranks per trainer world."""

    engine: str = "torch"
    engines: int = 2
    engine_tp: int = 1
    engine_dtype: str = "float32"
    runs: tuple[tuple[str, str], ...] = (("fsdp2", "mooncake"),)
    trainers: int = 2
    model: ModelSpec = field(default_factory=ModelSpec)
    updates: int = 2
    #: "cpu" or "cuda" (engines, trainer ranks and NCCL on GPUs, pinned buffers).
    device: str = "cpu"
    #: How every run's session moves weights; each run's way (SESSION_WAYS) is set on top.
    session: SessionOptions = field(default_factory=lambda: SessionOptions(bucket_bytes=64 << 10, check=True))
    #: After each update, every engine's greedy continuation next to the trainer's (torch engines).
    generate: bool = False
    progress: bool = False
    #: Where each run's engine ranks and oracle save what they hold; None: nothing is saved.
    dump_dir: str | None = None
    #: How long trainers wait for the engine ranks to come up.
    startup_timeout: float = 600.0
    job_id: str = field(default_factory=lambda: f"world-{os.getpid()}-{int(time.time())}")
    #: The port of the job's rendezvous on 127.0.0.1 (0: a free one).
    rendezvous_port: int = 0

    @property
    def transports(self) -> list[str]:
        """Every transport, in order of first use (the engines serve the first at start)."""
        return list(dict.fromkeys(t for _, t in self.runs))

    @property
    def trainer_kinds(self) -> list[str]:
        return list(dict.fromkeys(k for k, _ in self.runs))

    def transports_of(self, kind: str) -> list[str]:
        return [t for k, t in self.runs if k == kind]

    def session_for(self, way: str, **changes: Any) -> SessionOptions:
        """The session options of a run updating `way` (a key of SESSION_WAYS)."""
        return SessionOptions.of(self.session, **SESSION_WAYS[way], **changes)

    def ranks_of(self, kind: str) -> int:
        return TRAINER_RANKS.get(split_kind(kind)[0], self.trainers)


@dataclass(frozen=True)
class DeltaMemory:
    """One trainer rank's delta memory after a run (`SessionStats`), beside what bounds it:
    the bytes it produces in one update (gather-free and gathered) and how many target
    parameters it is connected to (each group's baseline slot is aligned)."""

    baseline_bytes: int
    patch_buffer_bytes: int
    produced_bytes: int
    params: int


@dataclass
class RunResult:
    """One run: its reports and generations per update, buckets per update, where it dumped,
    why the trainer's model did not hold its oracle's weights in meaning, and why it failed or
    was skipped ("" where it did not)."""

    trainer: str
    transport: str
    reports: list[UpdateReport] = field(default_factory=list)
    generations: list[dict[str, list[int]]] = field(default_factory=list)
    buckets: int = 0
    #: Bytes of one update trainer rank 0 sent without a gather, and produced from gathered
    #: tensors (`SessionStats.gather_free_bytes`).
    gather_free_bytes: tuple[int, int] = (0, 0)
    folder: str = ""
    meaning: str = ""
    error: str = ""
    skipped: str = ""
    #: What trainer rank 0 held for delta updates after the run.
    delta_memory: DeltaMemory | None = None
