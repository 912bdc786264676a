"""FSDP2 trainer ranks to two sglang engines of two ranks over Mooncake, each rank its own process."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e sglang`")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402
from sglang_e2e import TP, engine_config, engine_ids, engine_rank, trainer  # noqa: E402
from sglang_models import sglang_rank  # noqa: E402

from p2psync.demo import DemoOptions, launch  # noqa: E402


@pytest.mark.slow
def test_fsdp2_to_two_sglang_engines_of_two_ranks_over_mooncake_is_bit_exact(tmp_path):
    opts = DemoOptions(
        size="tiny", trainers=2, engines=2 * TP, updates=2, transport="mooncake",
        bucket_bytes=64 << 10, progress=False, dump_dir=str(tmp_path),
    )
    result = launch(opts, engine_rank, trainer)

    assert result["buckets"] > 1
    for report in result["reports"]:
        assert report.ok, report.format()
        for engine in report.engines.values():
            assert engine.checked and engine.bytes > 0
    trainer_tensors = torch.load(tmp_path / "trainer.pt")
    config = engine_config(opts.size)
    for rank in range(TP):
        expected, _ = sglang_rank(config, TP, 1, rank, trainer_tensors)
        for engine in engine_ids(opts):
            held = torch.load(tmp_path / f"{engine}-rank{rank}.pt")
            assert held.keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(held[name].view(torch.uint8), tensor.view(torch.uint8)), (engine, rank, name)
