"""What a Session is told: one frozen, typed set of options that users, integrations, the
bench and the worlds pass whole, instead of re-spelling the session's keywords."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast

from ..core.options import parse
from ..core.pause import PauseMode, pause_mode

DEFAULT_BUCKET_BYTES = 512 << 20
GATHER_MODES = ("auto", "always")


@dataclass(frozen=True)
class DeltaOptions:
    """Delta updates (`SessionOptions.delta`): `full_every` makes every N-th update a full
    one (0: only targets that need one get it); `memory_bytes` bounds the baselines a
    sender holds (None: no bound); units beyond it are always sent in full.
    `prove_baselines` (default on) has every engine show, at the start of each update,
    that its weights are still what the last update left (fingerprints the engine takes
    off the update's path; writes it sees itself): a rank that changed gets its full
    bytes in that update. Off, a change outside p2psync stays until the digest check
    (`check=True`) catches it, an update late, or a full update overwrites it."""

    full_every: int = 0
    memory_bytes: int | None = None
    prove_baselines: bool = True

    def __post_init__(self) -> None:
        if self.full_every < 0:
            raise ValueError(f"full_every must be 0 or more, got {self.full_every}")
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be 0 or more, got {self.memory_bytes}")


def parse_delta(value: bool | Mapping[str, object] | DeltaOptions | None) -> DeltaOptions | None:
    """The `delta` option: False/None (full updates), True (defaults), options or their mapping."""
    if value is None or value is False:
        return None
    if value is True:
        return DeltaOptions()
    return parse(DeltaOptions, value, what="delta")


@dataclass(frozen=True)
class SessionOptions:
    """How a Session moves weights; the same on every trainer rank.

    `bucket_bytes` bounds one bucket's gathers (a bucket is produced while the next is
    gathered: two are held at once); `transfer_timeout` bounds every write
    and control call; `check` compares a digest of every parameter each engine holds with
    what was sent; `token` is the job's secret that engines check (None: the
    rendezvous's); `transport_options` configure a transport given by name;
    `buffer_device` and `pin_memory` place the transfer buffers; `engine_options` are
    keyword options per engine kind, e.g. `{"vllm": {"layout": "replica"}}`.
    `update_lease` (None: four times `transfer_timeout`) is how long an engine paused for
    an update waits for the trainer to make progress before it abandons the update and
    marks itself stale. `gather`: "auto" (the default) sends every group whose bytes are
    copies of the ranks' own shards without a gather, each rank writing its own part, and
    gathers the rest; "always" gathers every HF tensor before producing bytes. `delta` (True, `DeltaOptions` or their mapping) sends each
    target only what changed since the bytes it holds. `layout_cache_dir` (default
    `$P2PSYNC_CACHE_DIR`; None: none) keeps compiled layouts on disk for later processes;
    every rank and job may share it. `pause` (a `p2psync.core.pause` mode, or vLLM's "keep")
    says what each engine does with its requests in flight during an update; None (the
    default) takes each engine's first mode that aborts nothing. `flush_cache` (default on)
    has each engine drop what its old weights computed (prefix and KV caches) when an update
    finishes; off, requests after the update may reuse prefixes the old weights computed.
    `strict_connect` (default off) fails a connect where any engine it names is not there to
    serve (no table in the rendezvous, no answer); off, those are left out by name and the
    others connect.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    transfer_timeout: float = 60.0
    check: bool = False
    token: str | None = None
    transport_options: Mapping[str, Any] | None = None
    buffer_device: str = "cpu"
    pin_memory: bool = False
    engine_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    update_lease: float | None = None
    gather: Literal["auto", "always"] = "auto"
    delta: bool | Mapping[str, Any] | DeltaOptions | None = None
    layout_cache_dir: str | None = field(default_factory=lambda: os.environ.get("P2PSYNC_CACHE_DIR") or None)
    pause: PauseMode | Literal["keep"] | None = None
    flush_cache: bool = True
    strict_connect: bool = False

    def __post_init__(self) -> None:
        if self.gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, got {self.gather!r}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.transfer_timeout <= 0:
            raise ValueError(f"transfer_timeout must be positive, got {self.transfer_timeout}")
        if self.update_lease is not None and self.update_lease <= 0:
            raise ValueError(f"update_lease must be positive, got {self.update_lease}")
        if self.pause is not None:
            object.__setattr__(self, "pause", pause_mode(self.pause))  # "keep" is vLLM's "in_place"
        object.__setattr__(self, "delta", parse_delta(self.delta))  # True or a mapping become DeltaOptions
        object.__setattr__(self, "engine_options", {k: dict(v) for k, v in (self.engine_options or {}).items()})

    @property
    def delta_options(self) -> DeltaOptions | None:
        """Delta mode's options, or None for full updates."""
        return self.delta if isinstance(self.delta, DeltaOptions) else None

    @property
    def pause_mode(self) -> PauseMode | None:
        """The pause mode asked for, typed as one (`__post_init__` turned an alias such as "keep"
        into its mode)."""
        return cast("PauseMode | None", self.pause)

    @property
    def lease_seconds(self) -> float:
        """The update lease in force."""
        return 4 * self.transfer_timeout if self.update_lease is None else self.update_lease

    @classmethod
    def of(cls, options: SessionOptions | Mapping[str, Any] | None = None, **changes: Any) -> SessionOptions:
        """`options` (an instance, a mapping or None) with keyword `changes` on top; an unknown
        option or a value of the wrong type is an OptionsError naming the valid ones."""
        base = parse(cls, options, what="Session")
        if not changes:
            return base
        return parse(cls, {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **changes}, what="Session")


class SessionChanges(TypedDict, total=False):
    """`SessionOptions`' fields as keywords (`Session(..., check=True)`), typed: a misspelt or
    mistyped option is an error mypy sees (`**changes: Unpack[SessionChanges]`). Kept equal to
    the dataclass's fields by a test."""

    bucket_bytes: int
    transfer_timeout: float
    check: bool
    token: str | None
    transport_options: Mapping[str, Any] | None
    buffer_device: str
    pin_memory: bool
    engine_options: Mapping[str, Mapping[str, Any]]
    update_lease: float | None
    gather: Literal["auto", "always"]
    delta: bool | Mapping[str, Any] | DeltaOptions | None
    layout_cache_dir: str | None
    pause: PauseMode | Literal["keep"] | None
    flush_cache: bool
    strict_connect: bool
