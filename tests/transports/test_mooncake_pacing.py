"""`WirePace`: how long a Mooncake writer sleeps before its spinning wait, learned per peer."""

import pytest

from p2psync.transports.mooncake.pacing import MIN_SLEEP, SHRINK, SLEEP_SHARE, WirePace

MB = 1 << 20


def test_the_first_batch_is_waited_for_without_a_sleep() -> None:
    assert WirePace().sleep_before_wait(64 * MB, timeout=30) == 0.0


def test_a_batch_still_in_flight_after_the_sleep_sets_the_rate() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)  # 64 MB landed in 1 s
    assert pace.sleep_before_wait(32 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * 0.5)
    pace.observe(32 * MB, slept=0.425, spun=0.375)  # slower now: 0.8 s for 32 MB
    assert pace.sleep_before_wait(32 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * 0.8)


def test_a_batch_that_landed_during_the_sleep_shrinks_the_estimate() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)
    pace.observe(64 * MB, slept=SLEEP_SHARE, spun=0.0)
    assert pace.sleep_before_wait(64 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * SHRINK)


def test_short_batches_are_not_slept_through_and_no_sleep_outlasts_the_timeout() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)
    assert pace.sleep_before_wait(int(64 * MB * MIN_SLEEP / 2), timeout=30) == 0.0
    assert pace.sleep_before_wait(64 * MB * 100, timeout=2.0) == 2.0


def test_an_empty_batch_teaches_nothing() -> None:
    pace = WirePace()
    pace.observe(0, slept=0.0, spun=0.5)
    assert pace.seconds_per_byte is None


class SpinningEngine:
    """Stands in for Mooncake's engine: every batch takes `seconds` to land, which its
    `get_batch_transfer_status` reports by how long it "spins" (a clock the test advances)."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds, self.spins = clock, seconds, []

    def batch_transfer_async_write(self, session, local, remote, lengths) -> int:  # noqa: ANN001
        self.landed = self.clock[0] + self.seconds
        return 1

    def get_batch_transfer_status(self, batch_ids) -> int:  # noqa: ANN001
        spin = max(0.0, self.landed - self.clock[0])
        self.spins.append(spin)
        self.clock[0] += spin
        return 0


def test_the_peer_sleeps_through_most_of_a_write_and_spins_only_its_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2psync.core.transport import WriteBatch
    from p2psync.transports.mooncake import transport

    clock = [0.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(transport.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    engine = SpinningEngine(clock, seconds=1.0)
    peer = transport.MooncakePeer(engine, "127.0.0.1:1")
    batch = WriteBatch()
    batch.add(0, 0, 64 * MB)
    for _ in range(3):
        peer.write(batch, timeout=30)
    assert engine.spins[0] == pytest.approx(1.0)  # nothing known yet: the whole write spun
    assert engine.spins[1:] == pytest.approx([1 - SLEEP_SHARE] * 2)
