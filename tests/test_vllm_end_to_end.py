"""FSDP2 (2 trainer ranks) -> 2 vLLM engines of TP 2 over Mooncake, through vLLM's own
weight-transfer flow with the "p2psync" backend; every engine rank bit-exact."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e vllm`")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402
from vllm_e2e import KIND, VllmE2EOptions, engine_config, engine_rank_main, trainer_main  # noqa: E402
from vllm_helpers import vllm_loaded  # noqa: E402

from p2psync.demo import launch  # noqa: E402


@pytest.mark.slow
def test_fsdp2_to_two_vllm_engines_of_two_ranks_over_mooncake_is_bit_exact(tmp_path):
    opts = VllmE2EOptions(
        size="tiny", trainers=2, engines=4, tp=2, updates=2, transport="mooncake",
        bucket_bytes=64 << 10, progress=False, dump_dir=str(tmp_path),
    )
    result = launch(opts, engine_rank_main, trainer_main)

    for report in result["reports"]:
        assert report.ok, report.format()
        assert set(report.engines) == {"engine-0", "engine-1"}
        for engine in report.engines.values():
            assert engine.checked and engine.bytes > 0

    trainer = torch.load(tmp_path / "trainer.pt")
    config = engine_config(opts)
    for rank in range(opts.tp):
        expected = vllm_loaded(config, rank, trainer)  # vLLM's own load of the final weights on this rank
        for engine in ("engine-0", "engine-1"):
            held = torch.load(tmp_path / f"{engine}-rank{rank}.pt")
            assert [c[0] for c in held["calls"]] == ["init_weight_transfer_engine"] + [
                "start_weight_update", "update_weights", "finish_weight_update"
            ] * opts.updates, (engine, rank)
            assert held["calls"][-2][1] == {"update_info": {"version": f"step-{opts.updates}"}}
            for name, p in expected.named_parameters():
                got = held["params"][name]
                assert torch.equal(got.view(torch.uint8), p.data.view(torch.uint8)), (KIND, engine, rank, name)
