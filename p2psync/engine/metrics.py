"""An engine rank's Prometheus metrics, in the text exposition format, served at `GET /metrics`
on its control server (no token: they name versions and states, never weights).

Labels: `job`, `engine`, `rank`. Gauges: `p2psync_engine_serving` (1 while it serves),
`p2psync_engine_stale` (1 while stale), `p2psync_engine_version_info` (1, the version held as a
label), `p2psync_engine_last_update_seconds` (from the pause to the finish of the last update),
`p2psync_engine_last_update_timestamp_seconds` (when it finished, Unix time); counters:
`p2psync_engine_updates_total` (updates finished), `p2psync_engine_stale_total` (times it went
stale).
"""

from __future__ import annotations

from collections.abc import Mapping

from .state import EngineState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposition(labels: Mapping[str, str], state: EngineState) -> str:
    """The metrics of one engine rank whose state is `state`."""
    lines: list[str] = []

    def metric(name: str, kind: str, what: str, value: float | None, extra: Mapping[str, str] | None = None) -> None:
        lines.extend([f"# HELP {name} {what}", f"# TYPE {name} {kind}"])
        if value is not None:
            lines.append(f"{name}{{{_labels({**labels, **(extra or {})})}}} {float(value)!r}")

    metric("p2psync_engine_serving", "gauge", "1 while the engine rank serves its weights", float(state.serving))
    metric("p2psync_engine_stale", "gauge", "1 while the engine rank is stale", float(state.stale is not None))
    metric("p2psync_engine_version_info", "gauge", "the version of the weights held, as a label",
           1.0 if state.version is not None else None, {"version": state.version or ""})
    metric("p2psync_engine_last_update_seconds", "gauge", "seconds from the pause to the finish of the last update",
           state.last_update_seconds)
    metric("p2psync_engine_last_update_timestamp_seconds", "gauge", "when the last update finished (Unix time)",
           state.finished_at)
    metric("p2psync_engine_updates_total", "counter", "updates finished", float(state.updates))
    metric("p2psync_engine_stale_total", "counter", "times the engine rank went stale", float(state.stale_marks))
    return "\n".join(lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return ",".join(f'{k}="{v}"' for k, v in escaped.items())
