"""FSDP2 trainer ranks to torch engines over each transport, each in its own process."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

import torch

from p2psync.demo import DemoOptions, run

#: Transport -> module it needs (None: torch alone).
TRANSPORTS = {"mooncake": "mooncake.engine", "samehost": None, "torchdist": None}


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_fsdp2_to_two_torch_engines_is_bit_exact(transport, tmp_path):
    if TRANSPORTS[transport]:
        pytest.importorskip(TRANSPORTS[transport], reason=f"transport {transport} needs {TRANSPORTS[transport]}")
    opts = DemoOptions(
        size="tiny", trainers=2, engines=2, updates=2, transport=transport,
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
