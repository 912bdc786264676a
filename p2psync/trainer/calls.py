"""Every control call the trainer makes to its engines, in one place.

World rank 0 checks access at connect, pauses the engines for an update, renews their
update leases as buckets go by and finishes the ones whose writes all landed; every
rank asks the targets it wrote to for digests and has them apply its delta patches.

The lease: an engine paused for an update waits `lease` seconds for the trainer to
finish or to renew; past that it abandons the update and marks itself stale (see
`p2psync.engine.state`). Renewing as buckets go by means a long update of a large model
never looks abandoned, while a trainer that died, or a world whose collectives hang,
stops renewing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from ..core.delta import PatchRecord
from ..core.engine import EngineControl
from ..core.errors import ConnectError, ControlError, EngineUnreachable, where
from ..core.pause import PauseMode, choose
from ..core.types import Region, TargetTable
from .delta_send import Held

log = logging.getLogger(__name__)


def silence(control: EngineControl) -> str | None:
    """Reach an engine once with the job's credentials (connect, world rank 0): None, or why it
    is left out (no answer, or another process answering at its address). An engine that
    refuses the credentials fails the connect (ConnectError): that is the trainer's to fix."""
    try:
        control.check_access()
    except EngineUnreachable as exc:
        return f"it does not answer (killed, stopped or cut off): {exc}"
    except ControlError as exc:
        raise ConnectError(str(exc)) from exc
    return None


def pause_modes(controls: Mapping[str, EngineControl], asked: PauseMode | None) -> dict[str, PauseMode]:
    """The mode each engine pauses in when `asked` (None: each its first that aborts nothing);
    OptionsError naming an engine that lacks the mode asked, and the modes it has."""
    return {engine: choose(asked, control.pause_modes(), engine) for engine, control in controls.items()}


def refuse_unchecked(controls: Mapping[str, EngineControl]) -> None:
    """For `check=True`: ConnectError naming every engine that cannot digest what it was written."""
    refused = [f"{where(engine)}: {why}" for engine, control in controls.items() if (why := control.digest_refusal())]
    if refused:
        raise ConnectError("check=True: " + "; ".join(refused))


def label_refusals(controls: Mapping[str, EngineControl], version: str, *, rollback: bool) -> list[str]:
    """Before an update (world rank 0): why engines refuse `version` as its label (each names
    itself). An engine that cannot be asked is left to the pause, which tells it apart."""
    refused = []
    for engine, control in controls.items():
        try:
            refusal = control.label_refusal(version, rollback=rollback)
        except ControlError as exc:
            log.info("engine %s could not be asked whether it takes version %r: %s", engine, version, exc)
            continue
        if refusal is not None:
            refused.append(refusal)
    return refused


class UpdateCalls:
    """The control calls of the update to `version`: engines paused in `modes`, their caches
    flushed at the finish if `flush_cache`; leases of `lease` seconds, renewed at most every
    quarter lease."""

    def __init__(
        self, controls: Mapping[str, EngineControl], version: str, lease: float, *, modes: Mapping[str, PauseMode],
        flush_cache: bool,
    ) -> None:
        self.controls = controls
        self.version = version
        self.lease = lease
        self.modes = modes
        self.flush_cache = flush_cache
        self._renewed = time.monotonic()

    def pause_all(self, gone: Callable[[str], str | None]) -> tuple[dict[str, str], list[TargetTable]]:
        """Pause every engine; the ones that refused or did not answer, with why (`gone(engine)`:
        what became of one that did not answer, where known), and the tables of the ranks whose
        transport moved (see `EngineControl.pause`)."""
        failed: dict[str, str] = {}
        moved: list[TargetTable] = []
        for engine, control in self.controls.items():
            try:
                paused = control.pause(self.version, self.lease, self.modes[engine], flush_cache=self.flush_cache)
                moved.extend(paused or ())
            except EngineUnreachable as exc:
                failed[engine] = f"pause failed: {gone(engine) or f'no answer (killed, stopped or cut off): {exc}'}"
            except ControlError as exc:
                failed[engine] = f"pause failed: {exc}"
        self._renewed = time.monotonic()
        return failed, moved

    def held(self, ranks: Mapping[str, int], skip: Collection[str]) -> Held:
        """Per engine not in `skip` (of `ranks[engine]` ranks) that can tell: per rank, the
        version it holds and why its weights may differ from what that update left; an
        engine that cannot be reached is taken as changed on every rank."""
        out: dict[str, Mapping[int, tuple[str | None, str | None]]] = {}
        for engine, control in self.controls.items():
            if engine in skip:
                continue
            try:
                held = control.held()
            except ControlError as exc:
                held = {rank: (None, f"it could not say what it holds: {exc}") for rank in range(ranks[engine])}
            if held:
                out[engine] = held
        return out

    def progressed(self, failed: Collection[str]) -> dict[str, str]:
        """The update made progress: renew the leases of the engines not `failed`, if due.
        Returns the engines whose renewal failed, with why: an engine that cannot be reached
        to renew its lease will abandon this update, so the caller gives up on it at once
        instead of waiting on its writes and calling it again."""
        now = time.monotonic()
        if now - self._renewed < self.lease / 4:
            return {}
        self._renewed = now
        lost = {}
        for engine, control in self.controls.items():
            if engine in failed:
                continue
            try:
                control.renew(self.version)
            except ControlError as exc:
                log.warning("renewing the update lease of engine %s failed: %s", engine, exc)
                lost[engine] = f"renewing its update lease failed: {exc}"
        return lost

    def finish(self, engine: str) -> str | None:
        """Post-process and resume `engine`; why that failed, or None. A finish that got no
        answer may still land (an engine stopped or cut off for a while): the engine is told to
        give the update up, which undoes a finish that landed and refuses one still on its way,
        so that the report (stale) is the truth either way."""
        control = self.controls[engine]
        try:
            control.finish(self.version)
        except EngineUnreachable as exc:
            why = f"finish got no answer: {exc}"
            try:
                control.fail(self.version, why)
            except ControlError as told:
                return f"{why}; told to give the update up, which it does once it hears ({told})"
            return f"{why}; it gave the update up"
        except ControlError as exc:
            return f"finish failed: {exc}"
        return None

    def fail(self, engine: str, reason: str) -> threading.Thread:
        """Tell `engine`, on a thread of its own (a stopped engine must not hold up the
        report), that this update failed on it and why; it stays out of serving."""

        def tell() -> None:
            try:
                self.controls[engine].fail(self.version, reason)
            except ControlError as exc:  # unreachable: its lease runs out instead
                log.warning("telling engine %s that its update failed did not reach it: %s", engine, exc)

        thread = threading.Thread(target=tell, name=f"p2psync-fail-{engine}", daemon=True)
        thread.start()
        return thread

    def digests(self, engine: str, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        """Digests of what `engine`'s `rank` holds in `regions` (raises ControlError)."""
        return self.controls[engine].digests(rank, regions)

    def patch(self, engine: str, rank: int, records: Sequence[PatchRecord]) -> Callable[[], None]:
        """The call that has `engine`'s `rank` apply the patch of `records` just written."""
        control = self.controls[engine]
        return lambda: control.apply_patch(rank, self.version, records)
