"""A Mooncake engine side that fences takes no more writes through what it exposed before:
a write the trainer gave up on, still on its way, cannot land after the fence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402

from p2psync.core.errors import TransferError  # noqa: E402
from p2psync.core.transport import WriteBatch  # noqa: E402
from p2psync.transports.mooncake.transport import MooncakeTransport  # noqa: E402


def _write(peer, buffer: torch.Tensor, target: torch.Tensor, timeout: float = 5.0) -> None:
    batch = WriteBatch()
    batch.add(buffer.data_ptr(), target.data_ptr(), buffer.numel() * buffer.element_size())
    peer.write(batch, timeout=timeout)


def test_after_a_fence_writes_through_the_old_exposure_fail_and_the_new_one_lands():
    engine, trainer = MooncakeTransport(options={"protocol": "tcp"}), MooncakeTransport(options={"protocol": "tcp"})
    target, buffer = torch.zeros(1024, dtype=torch.uint8), torch.full((1024,), 7, dtype=torch.uint8)
    try:
        before = engine.expose([target])
        trainer.register_buffer(buffer)
        old_peer = trainer.open(SimpleNamespace(engine_id="e", rank=0, transport_info=before))
        _write(old_peer, buffer, target)
        assert bool((target == 7).all())

        after = engine.fence([target])
        assert after["session"] != before["session"], (before, after)
        buffer.fill_(9)
        with pytest.raises(TransferError):
            _write(old_peer, buffer, target, timeout=3.0)
        assert bool((target == 7).all()), "a write through the fenced-off exposure landed"
        _write(trainer.open(SimpleNamespace(engine_id="e", rank=0, transport_info=after)), buffer, target)
        assert bool((target == 9).all())
    finally:
        trainer.close()
        engine.close()
