"""The vLLM engine adapter through the conformance suite (environment conformance-vllm):
layouts against vLLM's own load over every byte, and FSDP2 or Megatron-Core (TP 2) -> 2 vLLM
engines of TP 2 driven through vLLM's weight-transfer flow with the `p2psync` backend, over
every transport, against one vLLM engine world.

Every model and TP size is covered bit for bit in tests/adapters/vllm/test_layouts.py; here a
dense and an MoE/MLA case stand for the adapter in the matrix, with both layouts.
"""

from __future__ import annotations

import pytest

from p2psync.conformance import EngineCase, EngineTargetTests, RoundTripTests
from tests.helpers.matrix import TRANSPORTS, usable, way_rows

#: Every parameter byte before vLLM's load: padding the loader leaves alone keeps it.
FILL = 0xA5
CASES = [("qwen3", 2, "copy_map"), ("deepseek_v3", 2, "copy_map"), ("deepseek_v3", 2, "replica")]


@pytest.mark.parametrize(("kind", "tp", "layout"), CASES, ids=[f"{k}-tp{t}-{l}" for k, t, l in CASES])
class TestVllmEngine(EngineTargetTests):
    conformance = {"engine": "vllm"}

    @pytest.fixture
    def engine_case(self, kind, tp, layout):
        usable("engine_targets", "vllm")
        import torch

        from p2psync.adapters.vllm.target import VllmEngineTarget
        from tests.helpers.vllm_helpers import checkpoint, engine_rank

        tensors = checkpoint(kind)
        expected, table = engine_rank(kind, tp, tp - 1, tensors, fill=FILL)
        initial = {name: torch.full_like(t.view(torch.uint8), FILL) for name, t in expected.items()}
        return EngineCase(table, dict(tensors), initial, expected, VllmEngineTarget(layout=layout).layout)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("trainer", ["fsdp2", "megatron"])
class TestToVllm(RoundTripTests):
    """Oracles as for torch engines; each rank holds what vLLM's own `load_weights` makes of
    them on that rank, after vLLM's init / start / update / finish calls in its order."""

    conformance = {"engine": "vllm"}

    @pytest.fixture
    def round_trip(self, trainer, transport, worlds):
        return worlds.round_trip(trainer, "vllm", transport)


WAYS = way_rows(["mooncake"])


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "via", "transport"), WAYS, ids=["-".join(w) for w in WAYS])
class TestWaysToVllm(RoundTripTests):
    """The session's other ways of updating, through vLLM's weight-transfer flow and
    checked as above: gather-free (each trainer rank writes the part of every vLLM rank that its
    own rows feed) and delta (after a full first update, only what changed).
    Megatron-Core gather-free: each rank writes what its column and row splits, fused QKV and
    gate/up parts and vocabulary rows feed."""

    conformance = {"engine": "vllm"}

    @pytest.fixture
    def round_trip(self, trainer, via, transport, worlds):
        return worlds.round_trip(trainer, "vllm", transport, via=via)
