"""Which weight versions produced a response of an sglang server: for RL frameworks that tag
each token of a rollout with the policy version that sampled it.

A session names each update's version on the server as it finishes (`/update_weight_version`),
so a request in flight across an update records where the version changed; sglang 0.5.23
returns that in every response's `meta_info`: `weight_versions`, spans of output tokens, and
`weight_version`, the last one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `start` to `end` (exclusive) of one response came from weights `version`."""

    version: str
    start: int
    end: int


def version_spans(meta_info: Mapping[str, Any]) -> list[VersionSpan]:
    """The spans of one response's `meta_info`, first token first. A response without spans
    (an older server) came from one version, its `weight_version`, over all its
    `completion_tokens`. ValueError where it names no version at all."""
    spans = meta_info.get("weight_versions")
    if spans:
        return [VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    if meta_info.get("weight_version") is None:
        raise ValueError("the response names no weight version (meta_info has neither weight_versions nor weight_version)")
    return [VersionSpan(str(meta_info["weight_version"]), 0, int(meta_info.get("completion_tokens", 0)))]
