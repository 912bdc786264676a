"""FSDP2 trainer ranks to torch engines over Mooncake, each in its own process."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402

from p2psync.demo import DemoOptions, run  # noqa: E402


@pytest.mark.slow
def test_fsdp2_to_two_torch_engines_over_mooncake_is_bit_exact(tmp_path):
    opts = DemoOptions(
        size="tiny", trainers=2, engines=2, updates=2, transport="mooncake",
        bucket_bytes=64 << 10, progress=False, dump_dir=str(tmp_path),
    )
    result = run(opts)

    for report in result["reports"]:
        assert report.ok, report.format()
        for engine in report.engines.values():
            assert engine.checked and engine.bytes > 0
    for generations in result["generations"]:
        assert generations["engine-0"] == generations["trainer"]
        assert generations["engine-1"] == generations["trainer"]

    trainer = torch.load(tmp_path / "trainer.pt")
    for engine in ("engine-0", "engine-1"):
        held = torch.load(tmp_path / f"{engine}.pt")
        assert held.keys() == trainer.keys()
        for name, tensor in trainer.items():
            assert held[name].dtype == tensor.dtype, name
            assert torch.equal(held[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (engine, name)
