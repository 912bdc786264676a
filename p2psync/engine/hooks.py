"""What an engine does at each control call of its endpoint (`EngineHooks`), and what an
engine adapter's `serve` passes on to the endpoint (`EndpointOptions`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..core.pause import PauseMode


def _nothing() -> None:
    return None


def _no_pause(mode: PauseMode) -> None:
    return None


def _ignore(reason: str) -> None:
    return None


@dataclass
class EngineHooks:
    """What the engine does at each control call. Defaults do nothing.

    `pause(mode)` takes the engine out of serving (at the start of an update, and at start-up
    when the version of its weights is unknown), `resume` puts it back; they alternate.
    `mode` is one of `pause_modes` (best first; see `p2psync.core.pause`) and says what
    becomes of the engine's requests in flight: the endpoint itself drains its own `routes`
    in "wait" (the hook runs once none is in flight) and answers the calls an "abort" cut
    off with 503; "retract" and "in_place" are the engine's to carry out, so declare them
    only where the hook does. At start-up and when a successor retires the rank, the mode
    is "abort". `flush_cache` runs at the end of an update unless the trainer asked to
    keep caches. `on_stale(reason)` is called when the engine marks itself stale (an update
    abandoned by its trainer, a successor that replaced it), so that a framework can drain
    or restart it; the engine stays out of serving meanwhile.
    """

    pause: Callable[[PauseMode], None] = _no_pause
    pause_modes: tuple[PauseMode, ...] = ("wait", "abort")
    post_process: Callable[[], None] = _nothing
    flush_cache: Callable[[], None] = _nothing
    resume: Callable[[], None] = _nothing
    on_stale: Callable[[str], None] = _ignore
    #: Extra routes, e.g. {"generate": fn(body) -> dict}, served beside the standard ones, and only
    #: while the engine serves (else answered 503 with the reason).
    routes: Mapping[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = field(default_factory=dict)


class EndpointOptions(TypedDict, total=False):
    """What an engine adapter's `serve` passes on to `EngineEndpoint.serve` unchanged:
    `hooks`, the control server's `host`, the job's `token` (default: the rendezvous's),
    `transport_options`, the `version` the rank loaded, its `incarnation`, `extra` fields
    for its table, `patch_bytes` and `verify_seconds` (see `EngineEndpoint`)."""

    hooks: EngineHooks | None
    host: str
    token: str | None
    transport_options: Mapping[str, Any] | None
    version: str | None
    incarnation: int | None
    extra: Mapping[str, Any] | None
    patch_bytes: int | None
    verify_seconds: float | None
