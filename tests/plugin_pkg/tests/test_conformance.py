"""p2psync-testplugin through p2psync's conformance suite, run as its authors would once the
package is installed (`pip install tests/plugin_pkg`; in p2psync's CI, environment
conformance-torch): each of its classes, found through p2psync's registry, passes the base
class of what it provides, and the three together pass a round trip."""

from __future__ import annotations

import pytest
import torch

from p2psync import Rendezvous, Session, TargetParam, TargetTable, registry
from p2psync.conformance import (
    EngineCase,
    EngineTargetTests,
    RoundTripTests,
    SourceCase,
    TrainerSourceTests,
    TransportTests,
)

PACKAGE = "p2psync-testplugin"


def installed(kind: str, name: str) -> type:
    """The plugin's class, as p2psync's registry loads it from the installed package."""
    registration = registry().entries[kind].get(name)
    if registration is None:
        pytest.skip(f"{PACKAGE} is not installed (pip install tests/plugin_pkg)")
    assert registration.package == PACKAGE, registration
    return registration.cls


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(32, 16, generator=generator), "head.weight": torch.randn(7, 16, generator=generator)}


def table_of(engine: dict[str, torch.Tensor], transport_info: dict, job_id: str = "j") -> TargetTable:
    return TargetTable(
        engine_id="copy-0", rank=0, world_size=1, engine="testplugin-copy", layout_key={}, transport="testplugin-loopback",
        transport_info=transport_info, control_url="", job_id=job_id,
        params=tuple(
            TargetParam(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.data_ptr(), t.numel() * t.element_size())
            for n, t in engine.items()
        ),
    )


def loaded(engine: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The copy engine's own load: each parameter takes its HF tensor, cast to its dtype."""
    return {n: t.clone().copy_(tensors[n]) for n, t in engine.items()}


class TestLoopback(TransportTests):
    conformance = {"transport": "testplugin-loopback"}

    @pytest.fixture
    def make_transport(self):
        return installed("transports", "testplugin-loopback")


class TestCopyEngine(EngineTargetTests):
    conformance = {"engine": "testplugin-copy"}

    @pytest.fixture
    def engine_case(self):
        engine = {n: t.to(torch.bfloat16) for n, t in weights(1).items()}
        sources = weights(2)
        target = installed("engine_targets", "testplugin-copy")()
        return EngineCase(table_of(engine, {}), sources, engine, loaded(engine, sources), target.layout)


class TestDictSource(TrainerSourceTests):
    conformance = {"trainer": "testplugin-dict"}

    @pytest.fixture
    def source_case(self):
        tensors = weights(3)
        return SourceCase(installed("trainer_sources", "testplugin-dict")(tensors), tensors)


class TestRoundTrip(RoundTripTests):
    """The trainer, a copy engine in this process and the loopback transport, through a Session."""

    conformance = {"trainer": "testplugin-dict", "engine": "testplugin-copy", "transport": "testplugin-loopback"}

    @pytest.fixture
    def round_trip(self):
        source = installed("trainer_sources", "testplugin-dict")(weights(4))
        engine_side = installed("transports", "testplugin-loopback")()
        engine = {n: t.to(torch.bfloat16) for n, t in weights(5).items()}
        rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="plugin", is_server=True, timeout=5)

        def go():
            rendezvous.publish(table_of(engine, engine_side.expose(list(engine.values())), "plugin"))
            with Session(source=source, transport="testplugin-loopback", rendezvous=rendezvous, check=True) as session:
                session.connect(["copy-0"])
                report = session.update("v1")
            assert report.ok and report.engines["copy-0"].checked, report.format()
            engine_side.close()
            return {"copy-0[0]": (loaded(engine, source.gather(list(engine))), engine)}

        return go
