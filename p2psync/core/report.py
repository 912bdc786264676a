"""What an update did, per engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineReport:
    """One engine's part of an update.

    `seconds` runs from the start of the update to the last write that landed on
    the engine; `bytes` counts what all senders wrote to all its ranks, and
    `rank_bytes` what they wrote to each rank.
    """

    engine_id: str
    ok: bool
    bytes: int = 0
    rank_bytes: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    checked: bool = False
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class UpdateReport:
    """The result of `Session.update`; `stale` names every engine not resumed."""

    version: str
    seconds: float
    engines: dict[str, EngineReport] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines.values())

    @property
    def stale(self) -> list[str]:
        return sorted(e.engine_id for e in self.engines.values() if not e.ok)

    def format(self) -> str:
        lines = [f"update {self.version}: {self.seconds:.3f} s"]
        lines.append(f"  {'engine':<16} {'status':<7} {'bytes':>14} {'seconds':>9} {'GB/s':>7}  check")
        for e in sorted(self.engines.values(), key=lambda e: e.engine_id):
            status = "ok" if e.ok else "STALE"
            check = "digest ok" if e.checked and e.ok else ("-" if not e.checked else "")
            lines.append(f"  {e.engine_id:<16} {status:<7} {e.bytes:>14,} {e.seconds:>9.3f} {e.gbps:>7.2f}  {check}")
            if e.error:
                lines.append(f"    error: {e.error}")
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
