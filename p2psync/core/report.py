"""What a connect and an update did, per engine."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class ConnectReport:
    """The result of `Session.connect`: the engines connected, and why each other engine it
    named was left out (its table not in the rendezvous, no answer at its address); a left-out
    engine rejoins at a later connect once it answers. `phase_seconds`: where this rank's
    time went (`CONNECT_PHASES`, in order), so that a slow connect says which step was slow."""

    engines: list[str]
    left_out: dict[str, str] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.left_out


#: A connect's phases on a trainer rank: the engines' tables read (world rank 0) and shared;
#: the HF tensors this rank holds shards of, then every rank's specs; the engine ranks'
#: layouts (compiled, or from memory, disk or another rank); which engines answer; what this
#: rank sends (plan, buckets, gather-free packings); its transfer buffers (registered with the
#: transport); its peers, writers and engine control clients; the ranks agreeing on the
#: outcome (waiting for the slowest); the update mode's baselines (delta).
CONNECT_PHASES = ("tables", "shards", "specs", "layouts", "answers", "compile", "buffers", "open", "agree", "mode")


def format_phases(phase_seconds: Mapping[str, float]) -> str:
    """`12.30 s: tables 0.10, specs 0.50, layouts 8.00, ...` (the phases that took any time)."""
    spent = ", ".join(f"{phase} {s:.2f}" for phase, s in phase_seconds.items() if s >= 0.005)
    return f"{sum(phase_seconds.values()):.2f} s: {spent or 'nothing measurable'}"


@dataclass
class EngineReport:
    """One engine's part of an update.

    `seconds` runs from the start of the update to the last write that landed on
    the engine; `bytes` counts what all senders wrote to all its ranks, and
    `rank_bytes` what they wrote to each rank. `delta_ranks` are the ranks that
    received a delta (only what changed) rather than their full bytes. `pause` is the
    mode it paused in (`p2psync.core.pause`).
    """

    engine_id: str
    ok: bool
    bytes: int = 0
    rank_bytes: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    checked: bool = False
    error: str | None = None
    delta_ranks: list[int] = field(default_factory=list)
    pause: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class UpdateReport:
    """The result of `Session.update`; `stale` names every engine not resumed.

    In delta mode, `delta_memory_bytes` is the host memory all senders hold for it
    (baselines and patch buffers), and `changed_elements` of `compared_elements`
    changed since the delta targets' baselines. `degraded` says, in words, where the
    update took a slower way than asked (tensors gathered instead of sent gather-free,
    units sent in full instead of as deltas), so that nothing degrades silently.
    `gather_free_bytes` and `gathered_bytes`: what all senders produced of their units
    without a gather and from gathered tensors (a unit's bytes go to each of its targets).
    """

    version: str
    seconds: float
    engines: dict[str, EngineReport] = field(default_factory=dict)
    delta_memory_bytes: int = 0
    changed_elements: int = 0
    compared_elements: int = 0
    degraded: list[str] = field(default_factory=list)
    gather_free_bytes: int = 0
    gathered_bytes: int = 0
    #: Where this trainer rank's update spent its time (its own phases: pause, produce, gather,
    #: drain, verify, finish, ...), set on each rank once the update ends.
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def metrics(self, prefix: str = "p2psync/") -> dict[str, float]:
        """The update as one flat dict of numbers, for the framework's logger (wandb, TensorBoard,
        verl's metrics): seconds, bytes, GB/s, engines ok and stale, the bytes produced
        gather-free and from gathers, the delta's changed share, this rank's seconds per phase,
        and per engine its seconds, bytes, GB/s and whether it took the update (1 or 0)."""
        nbytes = sum(e.bytes for e in self.engines.values())
        out = {
            "seconds": self.seconds, "bytes": float(nbytes),
            "gbps": nbytes / self.seconds / 1e9 if self.seconds else 0.0,
            "engines_ok": float(sum(e.ok for e in self.engines.values())), "engines_stale": float(len(self.stale)),
            "gather_free_bytes": float(self.gather_free_bytes), "gathered_bytes": float(self.gathered_bytes),
        }
        if self.compared_elements:
            out["delta_changed_fraction"] = self.changed_fraction
        out.update({f"phase/{phase}_seconds": seconds for phase, seconds in self.phase_seconds.items()})
        for e in self.engines.values():
            out.update({
                f"engine/{e.engine_id}/seconds": e.seconds, f"engine/{e.engine_id}/bytes": float(e.bytes),
                f"engine/{e.engine_id}/gbps": e.gbps, f"engine/{e.engine_id}/ok": float(e.ok),
            })
        return {f"{prefix}{key}": value for key, value in out.items()}

    @property
    def changed_fraction(self) -> float:
        """Fraction of the compared elements that changed (0 when none was compared)."""
        return self.changed_elements / self.compared_elements if self.compared_elements else 0.0

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines.values())

    @property
    def stale(self) -> list[str]:
        return sorted(e.engine_id for e in self.engines.values() if not e.ok)

    def format(self) -> str:
        lines = [f"update {self.version}: {self.seconds:.3f} s"]
        lines.append(f"  {'engine':<16} {'status':<7} {'pause':<8} {'bytes':>14} {'seconds':>9} {'GB/s':>7}  check")
        for e in sorted(self.engines.values(), key=lambda e: e.engine_id):
            status = "ok" if e.ok else "STALE"
            check = "digest ok" if e.checked and e.ok else ("-" if not e.checked else "")
            if e.delta_ranks:
                check += f", delta to rank(s) {','.join(map(str, e.delta_ranks))}"
            lines.append(
                f"  {e.engine_id:<16} {status:<7} {e.pause or '-':<8} {e.bytes:>14,} {e.seconds:>9.3f} {e.gbps:>7.2f}  {check}"
            )
            if e.error:
                lines.append(f"    error: {e.error}")
        if self.gather_free_bytes or self.gathered_bytes:
            lines.append(f"  produced: {self.gather_free_bytes:,} bytes gather-free, {self.gathered_bytes:,} from gathers")
        lines += [f"  degraded: {note}" for note in self.degraded]
        if self.delta_memory_bytes:
            lines.append(
                f"  delta: {self.changed_fraction:.4%} of {self.compared_elements:,} elements changed; "
                f"senders hold {self.delta_memory_bytes:,} bytes for it"
            )
        return "\n".join(lines)


class PhaseClock:
    """Where one update's time went on this rank: `lap(phase)` charges the time since the
    previous lap (or since the clock was made) to `phase`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
