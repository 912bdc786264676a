"""torch.distributed transport on CPU (gloo): an engine rank in its own process receives."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from tests.helpers.transport import ENGINE_ID, assert_same, engine, expected_after, multi_range_batch

from p2psync.core.errors import TransferError, TransferTimeout
from p2psync.core.rendezvous import Rendezvous
from p2psync.transports.torchdist.transport import TorchDistTransport

WHO = f"engine '{ENGINE_ID}' rank 0"
MARGIN = 1.5  # seconds a failing write may take beyond its timeout


def trainer(rendezvous: Rendezvous, buffer: torch.Tensor) -> TorchDistTransport:
    side = TorchDistTransport()
    side.bind(rendezvous)
    side.register_buffer(buffer)
    return side


def test_writes_land_bit_for_bit_in_the_order_sent():
    buffer = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
    with engine("torchdist", "torchdist-exact") as (eng, rendezvous):
        side = trainer(rendezvous, buffer)
        peer = side.open(eng.table)
        batch = multi_range_batch(eng.table, buffer)
        held = eng.dump()
        for _ in range(2):  # the pair serves write after write
            held = expected_after(eng.table, held, batch, buffer)
            peer.write(batch, timeout=20)
            assert_same(eng.dump(), held)
            buffer.random_(0, 256)
        peer.close()
        side.close()


def test_a_stuck_engine_times_out_then_recovers_and_a_dead_one_fails_at_once():
    buffer = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
    with engine("torchdist", "torchdist-faults") as (eng, rendezvous):
        peer = trainer(rendezvous, buffer).open(eng.table)
        batch = multi_range_batch(eng.table, buffer)
        expected = expected_after(eng.table, eng.dump(), batch, buffer)

        eng.signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"{WHO}: torchdist write .* not done after 2.0 s"):
            peer.write(batch, timeout=2)
        assert time.monotonic() - start < 2 + MARGIN
        eng.signal(signal.SIGCONT)

        peer.write(batch, timeout=20)  # over a new pair: the timed-out one is closed on both sides
        assert_same(eng.dump(), expected)

        eng.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match=WHO):
            peer.write(batch, timeout=5)
        assert time.monotonic() - start < 5 + MARGIN


def test_concealed_memory_refuses_every_write_and_takes_them_again_once_exposed():
    """Outside updates the engine conceals its memory: a write (any sender's: pairs meet in the
    rendezvous, which anyone may write) is refused and none of its bytes lands; exposed again,
    on the same channel, writes land."""
    buffer = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
    with engine("torchdist", "torchdist-conceal") as (eng, rendezvous):
        peer = trainer(rendezvous, buffer).open(eng.table)
        batch = multi_range_batch(eng.table, buffer)
        held = eng.dump()
        assert eng.call("conceal") is True
        with pytest.raises(TransferError):
            peer.write(batch, timeout=5)
        assert_same(eng.dump(), held)

        assert eng.call("expose") == eng.table.transport_info
        peer.write(batch, timeout=20)
        assert_same(eng.dump(), expected_after(eng.table, held, batch, buffer))
