"""The ways the bench syncs the trainer's weights into the engines, side by side.

A `Way` runs on every trainer rank (its updates are collective); `update` is timed from a
trainer barrier until the engines hold the weights. Each way says what it gathers (the
buckets, and the dtype each HF tensor is gathered in), so that the bench can time those
gathers alone, and what it moved (bytes sent by this rank, measured) and where its time
went (`phase_seconds`). To add a way, subclass `Way` and add it in `make_ways`.

- `p2p`: p2psync's gathering session, `Session(gather="always")` (gathers cast to the
  engines' dtype where the layouts only copy).
- `gather-free`: p2psync's default session (`gather="auto"`): each trainer rank writes the
  part its own shards feed of every target, without a gather, where the layouts only copy.
- `broadcast`: the best broadcast a user can build from the same pieces (see `broadcast`):
  gathers already cast to the engines' dtype, one flat buffer per bucket, the next bucket's
  gathers overlapping this one's broadcast.
- `broadcast-chain`: the same, each bucket relayed along a pipelined chain of the engine
  ranks (every link carries the bytes once, as NCCL's ring broadcast) instead of gloo's own
  broadcast.
- `broadcast-fp32`: the same broadcast gathering in the trainer's dtype and casting after,
  as verl's FSDP path does; present where the engines' dtype is not the trainer's. The
  engines' own loaders get exactly what a checkpoint holds: the reference the other ways'
  bytes are compared with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core.pause import choose
from ..core.report import PhaseClock
from . import broadcast

if TYPE_CHECKING:
    import torch

    from ..core.engine import EngineControl
    from ..core.report import UpdateReport
    from ..trainer.session import Session
    from ..core.source import TrainerSource

Progress = Callable[[], object]



def version_label(n: int) -> str:
    """The label of every way's `n`-th update: the ways of a round write the same weights, so
    they name them alike (an engine's label says which weights it holds, whichever way wrote
    them: what a delta session checks before it patches). Each p2p way after the first goes
    back to them as a rollback, which an engine serves only with the weights the label named."""
    return f"update-{n}"

class Way(ABC):
    """One way of syncing, on one trainer rank."""

    name: str
    description: str
    #: Whether the engines' own loaders turn the trainer's tensors into their bytes here (the reference).
    reference: bool = False

    @abstractmethod
    def update(self, progress: Progress, *, check: bool = False) -> float:
        """One update (collective over the trainer ranks); seconds from a trainer barrier until
        the engines hold it. `check`: verify what landed where the way can (untimed rounds)."""

    @abstractmethod
    def gathers(self) -> tuple[list[list[str]], dict[str, str]]:
        """The buckets one update gathers, in order, and the dtype each HF tensor is gathered in
        where it is not the trainer's."""

    @property
    @abstractmethod
    def phase_seconds(self) -> dict[str, float]:
        """Where this rank's last update spent its time."""

    @property
    @abstractmethod
    def sent_bytes(self) -> int:
        """Bytes this rank sent in its last update."""

    def to_json(self) -> dict[str, Any]:
        return {"description": self.description, "reference": self.reference}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


class P2PWay(Way):
    """p2psync: `Session.update`."""

    def __init__(self, session: Session, name: str, description: str) -> None:
        self.session = session
        self.name, self.description = name, description
        #: Bytes of an update this rank sends gather-free and produces from gathers (the session is connected).
        self.split = session.stats().gather_free_bytes
        self.reports: list[UpdateReport] = []
        #: Per update: when this rank's writes ran (monotonic clock).
        self.write_intervals: list[list[tuple[float, float]]] = []

    def update(self, progress: Progress, *, check: bool = False) -> float:
        def step(done: int, total: int) -> None:
            progress()

        _barrier()
        checking, self.session.check = self.session.check, check or self.session.check
        try:
            report = self.session.update(version_label(len(self.reports) + 1), progress=step, rollback=True)
        finally:
            self.session.check = checking
        if not report.ok:
            raise RuntimeError(report.format())
        self.reports.append(report)
        self.write_intervals.append(self.session.stats().write_intervals)
        return report.seconds

    def gathers(self) -> tuple[list[list[str]], dict[str, str]]:
        return self.session.stats().buckets, self.session.stats().gather_dtypes

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self.session.stats().phase_seconds

    @property
    def sent_bytes(self) -> int:
        return self.session.stats().sent_bytes  # counted by the writers: every completed write's bytes

    def to_json(self) -> dict[str, Any]:
        free, gathered = self.split
        return {**super().to_json(), "p2psync": True, "gather_free_bytes": free, "gathered_bytes": gathered}


class BroadcastWay(Way):
    """The broadcast path (`broadcast`), gathering in `gather_dtype` (None: the trainer's) and
    sending in the engines' dtype. `leader` on trainer rank 0, with `controls`, the engines'
    control clients: it pauses and finishes the engines as p2psync does (and as miles' and
    slime's broadcast paths pause and resume generation), so that both pay the same calls."""

    def __init__(
        self, name: str, description: str, source: TrainerSource, buckets: list[list[str]],
        leader: broadcast.Leader | None, gather_dtype: str | None, controls: Sequence[EngineControl] = (),
        lease: float = 600.0, reference: bool = False, mode: broadcast.Mode = "tree",
    ) -> None:
        self.name, self.description, self.reference = name, description, reference
        self.mode = mode
        self.source = source
        self.buckets = buckets
        self.leader = leader
        self.controls = controls
        self.lease = lease  # seconds an engine stays paused for an update that does not finish
        self._updates = 0
        self.casts = {n: gather_dtype for b in buckets for n in b} if gather_dtype else {}
        self._clock = PhaseClock()
        self._sent = 0

    def _gather(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        return self.source.gather_cast(names, {n: self.casts[n] for n in names if n in self.casts})

    def update(self, progress: Progress, *, check: bool = False) -> float:
        import time

        _barrier()
        start = time.monotonic()
        self._clock = PhaseClock()
        if self.leader is not None:
            self._updates += 1
            version = version_label(self._updates)
            for control in self.controls:  # in the mode a session takes by default, as the p2p ways do
                control.pause(version, self.lease, choose(None, control.pause_modes(), "of the bench"))
            self._clock.lap("pause")
            self.leader.send(self._gather, self._clock, progress, self.mode)
            self._sent = self.leader.sent_bytes
            for control in self.controls:
                control.finish(version)
            self._clock.lap("finish")
        else:
            broadcast.follow(self._gather, self.buckets, progress)
            self._clock.lap("gather")
        return time.monotonic() - start

    def gathers(self) -> tuple[list[list[str]], dict[str, str]]:
        return self.buckets, dict(self.casts)

    @property
    def phase_seconds(self) -> dict[str, float]:
        return dict(self._clock.seconds)

    @property
    def sent_bytes(self) -> int:
        return self._sent  # what this rank's broadcast-group threads wrote (rank 0 only)


def make_ways(
    names: Sequence[str], session: Session, source: TrainerSource, buckets: list[list[str]],
    leader: broadcast.Leader | None, controls: Sequence[EngineControl], engine_dtype: str | None,
    gather_free: Session | None = None,
) -> list[Way]:
    """The ways `names` asks for, in that order; `engine_dtype` None: the engines hold the
    trainer's dtype (then `broadcast-fp32` would be `broadcast` again, and is left out);
    `session`: the connected gathering session; `gather_free`: the connected default
    session (`gather="auto"`) of the gather-free way."""
    available: dict[str, Callable[[], Way]] = {
        "p2p": lambda: P2PWay(session, "p2p", "p2psync, gathering: Session(gather=\"always\")"),
        "broadcast": lambda: BroadcastWay(
            "broadcast", "broadcast, gathers in the engines' dtype (cast before the all-gather), overlapped with the "
            "broadcasts", source,
            buckets, leader, engine_dtype, controls, session.update_lease, reference=engine_dtype is None,
        ),
        "broadcast-chain": lambda: BroadcastWay(
            "broadcast-chain", "broadcast's gathers and buffers, each bucket relayed in pieces along a chain of the "
            "engine ranks (every link carries it once: NCCL's ring broadcast)", source, buckets, leader, engine_dtype,
            controls, session.update_lease, mode="chain",
        ),
    }
    if gather_free is not None:
        available["gather-free"] = lambda: P2PWay(
            gather_free, "gather-free", "p2psync's default session, gather-free: each trainer rank writes its own shards' part"
        )
    if engine_dtype is not None:
        available["broadcast-fp32"] = lambda: BroadcastWay(
            "broadcast-fp32", "broadcast, gathers in the trainer's dtype then cast (verl's FSDP path)", source,
            buckets, leader, None, controls, session.update_lease, reference=True,
        )
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"unknown way(s) {unknown}; these engines offer {list(available)}")
    return [available[n]() for n in names]


WAYS = ("p2p", "gather-free", "broadcast", "broadcast-chain", "broadcast-fp32")
