"""The built-in adapters and transports through the conformance suite."""

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

#: Transport name -> module that must import for it to run here.
TRANSPORTS = {"mooncake": "mooncake.engine", "nixl": "nixl_cu12", "samehost": "torch", "torchdist": "torch.distributed"}


def need(module: str, what: str) -> None:
    pytest.importorskip(module, reason=f"{what} needs {module}, which is not installed")


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestTransport(TransportTests):
    conformance: dict[str, str] = {}

    @pytest.fixture
    def make_transport(self, transport):
        need(TRANSPORTS[transport], f"transport {transport}")
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
        engine.load_state_dict(sources)  # the engine's own loader: param.copy_(hf), casting to bf16
        target = registry().engine_target("torch")()
        return EngineCase(table, sources, dict(engine.state_dict()), target.layout)


class TestFSDP2Source(TrainerSourceTests):
    conformance = {"trainer": "fsdp2"}

    @pytest.fixture
    def source_case(self):
        model = small_model(3)
        compiled = torch.nn.Module()
        compiled._orig_mod = model  # the wrapper prefix torch.compile adds must not reach HF names
        source = registry().trainer_source("fsdp2")(compiled)
        return SourceCase(source, {n: t.clone() for n, t in model.state_dict().items()})


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("device", DEVICES)
class TestFSDP2ToTorch(RoundTripTests):
    conformance = {"trainer": "fsdp2", "engine": "torch"}

    @pytest.fixture
    def round_trip(self, transport, device, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        need("transformers", "the FSDP2 round trip's model")
        require_device(device, registry().transport(transport))
        from p2psync.demo import DemoOptions, run

        def go():
            result = run(DemoOptions(size="tiny", updates=2, transport=transport, device=device, progress=False,
                                     bucket_bytes=64 << 10, dump_dir=str(tmp_path)))
            for report, generations in zip(result["reports"], result["generations"]):
                assert report.ok and all(e.checked and e.bytes > 0 for e in report.engines.values()), report.format()
                # Greedy generation on each engine equals the trainer's own after every update.
                assert generations["engine-0"] == generations["engine-1"] == generations["trainer"], generations
            trainer = torch.load(tmp_path / "trainer.pt", map_location="cpu")
            return {
                e: (trainer, torch.load(tmp_path / f"{e}.pt", map_location="cpu")) for e in ("engine-0", "engine-1")
            }

        return go
