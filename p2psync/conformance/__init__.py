"""The conformance suite: base test classes that every adapter and transport passes.

An implementer subclasses the base class of what it provides and supplies its
fixtures (`TransportTests.make_transport`, `EngineTargetTests.engine_case`,
`TrainerSourceTests.source_case`, `RoundTripTests.round_trip`); pytest collects
the inherited tests. The pytest plugin (`p2psync.conformance.plugin`, loaded
through the `pytest11` entry point) adds the options that pick adapters and the
trainer x engine x transport table at the end of a run.
"""

from .base import (
    EngineCase,
    EngineTargetTests,
    RoundTrip,
    RoundTripTests,
    SourceCase,
    TrainerSourceTests,
    TransportTests,
    require_device,
)

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
