"""The conformance suite: base test classes that every adapter and transport passes.

An implementer subclasses the base class of what it provides and supplies its
fixtures (`TransportTests.make_transport`, `EngineTargetTests.engine_case`,
`TrainerSourceTests.source_case`, `RoundTripTests.round_trip`); pytest collects
the inherited tests. The pytest plugin (`p2psync.conformance.plugin`, loaded
through the `pytest11` entry point) adds the options that pick adapters and the
trainer x engine x transport table at the end of a run. Round trips run on
`p2psync.worlds`, the runtime that starts trainer and engine processes (the demo and
the bench run on it too).

The base classes import pytest, so they load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EngineCase",
    "EngineTargetTests",
    "RoundTrip",
    "RoundTripTests",
    "SourceCase",
    "TrainerSourceTests",
    "TransportTests",
    "require_device",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
