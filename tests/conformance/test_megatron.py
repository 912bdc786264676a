"""Megatron-Core (TP 2, gloo) -> two torch engines, end to end through the conformance suite."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron round trip needs megatron-core (extra 'megatron')")

from test_builtin import TRANSPORTS, need  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/megatron_harness.py, also for spawned ranks

from p2psync.conformance import RoundTripTests  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestMegatronToTorch(RoundTripTests):
    conformance = {"trainer": "megatron", "engine": "torch"}

    @pytest.fixture
    def round_trip(self, transport, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        need("transformers", "the Megatron round trip's engines")
        from megatron_harness import e2e_trainer

        from p2psync.demo import DemoOptions, engine_ids, engine_main, launch

        def go():
            opts = DemoOptions(size="tiny", trainers=2, engines=2, updates=2, transport=transport, progress=False,
                               bucket_bytes=16 << 10, dump_dir=str(tmp_path))
            result = launch(opts, engine_main, partial(e2e_trainer, engine_ids=engine_ids))
            assert all(r.ok for r in result["reports"]), [r.format() for r in result["reports"]]
            trainer = torch.load(tmp_path / "trainer.pt")
            return {e: (trainer, torch.load(tmp_path / f"{e}.pt")) for e in engine_ids(opts)}

        return go
