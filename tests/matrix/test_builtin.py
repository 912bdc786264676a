"""The built-in adapters and transports through the conformance suite (environment
conformance-torch; Megatron-Bridge in environment bridge): every transport, the torch
engine's layout, the FSDP2 source, and FSDP2, Megatron-Core (TP 2) and Megatron-Bridge
(TP 2 x PP 2) trainers -> two torch engines over every transport, all against one torch
engine world per device."""

from __future__ import annotations

import pytest
import torch

from p2psync.conformance import (
    EngineCase,
    EngineTargetTests,
    RoundTripTests,
    SourceCase,
    TrainerSourceTests,
    TransportTests,
    require_device,
)
from p2psync.core.devices import DEVICES
from p2psync.core.plugins import registry
from p2psync.core.types import TargetParam, TargetTable
from tests.helpers.matrix import TRANSPORTS, usable, way_rows


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))


@pytest.mark.parametrize("transport", TRANSPORTS)
class TestTransport(TransportTests):
    conformance: dict[str, str] = {}

    @pytest.fixture
    def make_transport(self, transport):
        usable("transports", transport)
        return lambda: registry().transport(transport)()


class TestTorchEngine(EngineTargetTests):
    conformance = {"engine": "torch"}

    @pytest.fixture
    def engine_case(self):
        engine = small_model(1).to(torch.bfloat16)
        sources = dict(small_model(2).state_dict())
        table = TargetTable(
            engine_id="e", rank=0, world_size=1, engine="torch", layout_key={}, transport="mooncake",
            transport_info={}, control_url="", job_id="j",
            params=tuple(
                TargetParam(n, tuple(p.shape), "bfloat16", p.data_ptr(), p.numel() * p.element_size())
                for n, p in engine.named_parameters()
            ),
        )
        initial = {n: p.detach().clone() for n, p in engine.named_parameters()}
        engine.load_state_dict(sources)  # the engine's own loader: param.copy_(hf), casting to bf16
        target = registry().engine_target("torch")()
        return EngineCase(table, sources, initial, dict(engine.named_parameters()), target.layout)


class TestFSDP2Source(TrainerSourceTests):
    conformance = {"trainer": "fsdp2"}

    @pytest.fixture
    def source_case(self):
        model = small_model(3)
        compiled = torch.nn.Module()
        compiled._orig_mod = model  # the wrapper prefix torch.compile adds must not reach HF names
        source = registry().trainer_source("fsdp2")(compiled)
        return SourceCase(source, {n: t.clone() for n, t in model.state_dict().items()})


def on_devices(trainer: str) -> list[str]:
    """The devices the harness builds `trainer` on: Megatron trainers on CPU only."""
    return list(DEVICES) if trainer == "fsdp2" else ["cpu"]


TRAINER_DEVICES = [(t, d) for t in ("fsdp2", "megatron", "megatron-bridge") for d in on_devices(t)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("trainer", "device"), TRAINER_DEVICES, ids=["-".join(p) for p in TRAINER_DEVICES])
class TestToTorch(RoundTripTests):
    """Oracles: FSDP2's full state dict from torch's `get_model_state_dict`; for Megatron and
    Megatron-Bridge, the transformers model every rank trains alike and loads into its shards.
    Engines hold what `load_state_dict` of those makes, and generate as the trainer does."""

    conformance = {"engine": "torch"}

    @pytest.fixture
    def round_trip(self, trainer, transport, device, worlds):
        require_device(device)
        return worlds.round_trip(trainer, "torch", transport, device)


#: Megatron-Bridge gather-free over one transport (environment bridge: its gathering rows run three);
#: FSDP2 and Megatron-Core gather-free plus delta over one.
WAYS = way_rows(TRANSPORTS) + [
    ("megatron-bridge", "gather-free", "mooncake"), ("fsdp2", "gather-free+delta", "mooncake"),
    ("megatron", "gather-free+delta", "mooncake"),
]


WAYS_ON_DEVICES = [(*way, d) for way in WAYS for d in on_devices(way[0])]


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "via", "transport", "device"), WAYS_ON_DEVICES,
                         ids=["-".join(w) for w in WAYS_ON_DEVICES])
class TestWaysToTorch(RoundTripTests):
    """The session's other ways of updating, oracles and generation as above: gather-free
    (each trainer rank writes its own shards' part straight into the engines' parameters: FSDP2's
    rows; Megatron-Core TP 2's column and row splits, fused QKV and gate/up parts, vocabulary
    rows; Megatron-Bridge TP 2 x PP 2 where its mappings are those conversions), delta
    (FSDP2: after a full first update, only what changed) and both (each FSDP2 rank sends only
    what changed of its own rows, against a baseline of just those; Megatron-Core TP 2 the same
    with its own splits)."""

    conformance = {"engine": "torch"}

    @pytest.fixture
    def round_trip(self, trainer, transport, device, via, worlds):
        require_device(device)
        return worlds.round_trip(trainer, "torch", transport, device, via=via)
