"""The EngineTarget protocol: what the trainer side needs to know about an engine kind."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .delta import PatchRecord
from .errors import ControlError
from .layout import Layout
from .options import NoOptions, parse
from .pause import PauseMode
from .types import ParamSpec, Region, TargetTable


class EngineControl(ABC):
    """Control calls to one engine (all its ranks), made by the trainer around an update."""

    @abstractmethod
    def check_access(self) -> None:
        """Reach every rank once with the job's credentials; raise ControlError if
        one is unreachable or refuses them. Called at connect."""

    def pause_modes(self) -> tuple[PauseMode, ...]:
        """The pause modes (`p2psync.core.pause`) this engine has, best first; known without a
        call to the engine, so that every trainer rank checks a session's mode alike."""
        return ("abort",)

    @abstractmethod
    def pause(
        self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True
    ) -> Sequence[TargetTable] | None:
        """Stop serving so that no request reads weights while they change, for an update
        to `version`; `mode` (one of `pause_modes()`) says what becomes of the requests in
        flight, `flush_cache` whether the update drops what the old weights computed (prefix
        and KV caches: some engines clear them as they pause, others as they finish).
        Engines that hold leases mark the update abandoned (and stay out of serving) unless
        it finishes, or is renewed, within `lease` seconds. Returns the
        tables of the ranks whose transport info changed since the trainer read them (a
        rank that fenced off the writes of an update that never finished: see
        `Transport.fence`); the trainer writes to them there from now on."""

    def renew(self, version: str) -> None:
        """Extend the lease of the update to `version` (the trainer is making progress)."""

    @abstractmethod
    def finish(self, version: str) -> None:
        """After every write landed: post-process, drop what the old weights computed (unless
        the pause said not to), set the weight version, resume serving."""

    def fail(self, version: str, reason: str) -> None:
        """The trainer gave up on the update to `version` for `reason` (a failed digest check
        naming every parameter, failed writes): mark the engine stale now, out of serving
        until a later update finishes. Engines without it stay paused until their lease runs
        out."""

    @abstractmethod
    def digests(self, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        """Digest of the bytes `rank` holds in the given regions of each parameter."""

    def digest_refusal(self) -> str | None:
        """Why this engine cannot digest what it was written, or None; a session with
        `check=True` refuses it at connect, before anything is written."""
        return None

    def label_refusal(self, version: str, *, rollback: bool) -> str | None:
        """Why this engine refuses `version` as the label of the next update's weights (a
        label it served before names those weights, and the update is no rollback to them),
        or None. Asked before anything is paused (raises ControlError where it cannot be
        reached); engines that keep no labels take any."""
        return None

    def held(self) -> dict[int, tuple[str | None, str | None]]:
        """Per rank, the version it holds and why its weights may no longer be what that
        version's update left (written outside p2psync: a load route, a hook that rewrote
        them, a stray write), or None. Asked at the start of every delta update, after
        `pause`: a rank that holds another version than the trainer's baseline, or whose
        weights changed, gets its full bytes; from the first call on, the engine
        fingerprints what each update leaves. {} where the engine cannot tell (raises
        ControlError where it cannot be reached)."""
        return {}

    def apply_patch(self, rank: int, version: str, records: Sequence[PatchRecord]) -> None:
        """Have `rank` scatter the delta patch written into its patch area into its
        parameters, before its next patch lands there; only as part of the update to
        `version`. Only engines that publish a patch area (those served by p2psync's
        endpoint) take patches."""
        raise ControlError(f"{type(self).__name__} takes no delta patches")

    def close(self) -> None:
        """Drop connections."""


class EngineTarget(ABC):
    """An engine kind (sglang, vLLM, a torch module) as seen from the trainer.

    Constructed with keyword-only options, checked against the `Options` dataclass the
    class declares (an unknown option is an error). Engine-side code (the endpoint that
    runs inside an engine worker) lives beside it in the same adapter.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    #: The options this engine kind takes (a frozen dataclass).
    Options: ClassVar[type] = NoOptions

    def __init__(self, **options: Any) -> None:
        self.options: Any = parse(self.Options, options, what=f"engine target {self.name!r}")

    @abstractmethod
    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        """Build the layout for `table`'s layout key and rank from the trainer's HF tensors.

        Raises ConnectError naming engine, rank and parameter for anything it
        cannot reproduce exactly.
        """

    @abstractmethod
    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        """A control client for the engine whose ranks published `tables`; `token` is
        the job's secret, which the engine checks on every call."""
