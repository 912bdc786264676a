"""The vLLM engine adapter through the conformance suite (environment `conformance-vllm`):
layouts against vLLM's own load, and FSDP2 or Megatron-Core (TP 2) -> 2 vLLM engines of TP 2 driven through
vLLM's weight-transfer flow with the `p2psync` backend.

Every model and TP size is covered bit for bit in tests/test_vllm_layouts.py; here a
dense and an MoE/MLA case stand for the adapter in the matrix, with both layouts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the vLLM test helpers

import torch  # noqa: E402
from vllm_e2e import VllmE2EOptions, engine_config, engine_rank_main, megatron_trainer_main, trainer_main  # noqa: E402
from test_builtin import TRANSPORTS, need  # noqa: E402
from vllm_helpers import checkpoint, engine_rank, vllm_loaded  # noqa: E402

from p2psync.adapters.vllm.target import VllmEngineTarget  # noqa: E402
from p2psync.conformance import EngineCase, EngineTargetTests, RoundTrip, RoundTripTests  # noqa: E402
from p2psync.demo import launch  # noqa: E402

CASES = [("qwen3", 2, "copy_map"), ("deepseek_v3", 2, "copy_map"), ("deepseek_v3", 2, "replica")]


@pytest.mark.parametrize(("kind", "tp", "layout"), CASES, ids=[f"{k}-tp{t}-{l}" for k, t, l in CASES])
class TestVllmEngine(EngineTargetTests):
    conformance = {"engine": "vllm"}

    @pytest.fixture
    def engine_case(self, kind, tp, layout):
        tensors = checkpoint(kind)
        expected, table = engine_rank(kind, tp, tp - 1, tensors)
        return EngineCase(table, dict(tensors), expected, VllmEngineTarget(layout=layout).layout)


def vllm_round_trip(transport: str, tmp_path: Path, trainer: Callable[..., None]) -> RoundTrip:
    """2 `trainer` ranks -> 2 vLLM engines of TP 2, 2 updates over `transport`, through vLLM's
    weight-transfer flow: per engine rank, vLLM's own load of the trainer's final HF tensors and
    the bytes the rank holds."""

    def go():
        opts = VllmE2EOptions(
            size="tiny", trainers=2, engines=4, tp=2, updates=2, transport=transport,
            bucket_bytes=64 << 10, progress=False, dump_dir=str(tmp_path),
        )
        result = launch(opts, engine_rank_main, trainer)
        assert all(r.ok for r in result["reports"]), [r.format() for r in result["reports"]]
        trainer_tensors = torch.load(tmp_path / "trainer.pt")
        config = engine_config(opts)
        out = {}
        for rank in range(opts.tp):
            expected = {n: p.data for n, p in vllm_loaded(config, rank, trainer_tensors).named_parameters()}
            for engine in ("engine-0", "engine-1"):
                held = torch.load(tmp_path / f"{engine}-rank{rank}.pt")
                # Driven through vLLM's own weight-transfer flow, in its order, every update.
                assert [c[0] for c in held["calls"]] == ["init_weight_transfer_engine"] + [
                    "start_weight_update", "update_weights", "finish_weight_update"
                ] * opts.updates, (engine, rank)
                assert held["calls"][-2][1] == {"update_info": {"version": f"step-{opts.updates}"}}
                out[f"{engine}[{rank}]"] = (expected, held["params"])
        return out

    return go


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestFSDP2ToVllm(RoundTripTests):
    conformance = {"trainer": "fsdp2", "engine": "vllm"}

    @pytest.fixture
    def round_trip(self, transport, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        return vllm_round_trip(transport, tmp_path, trainer_main)


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestMegatronToVllm(RoundTripTests):
    """Megatron-Core TP 2 (dense Qwen3, the vLLM tests' model: its vocabulary is padded on each vLLM rank)."""

    conformance = {"trainer": "megatron", "engine": "vllm"}

    @pytest.fixture
    def round_trip(self, transport, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        need("megatron.core", "the Megatron trainer (extra 'megatron')")
        return vllm_round_trip(transport, tmp_path, megatron_trainer_main)
