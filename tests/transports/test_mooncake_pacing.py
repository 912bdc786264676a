"""`WirePace`: how long a Mooncake writer sleeps before its spinning wait, learned per peer."""

import pytest

from p2psync.transports.mooncake.pacing import LEARN_BYTES, MIN_SLEEP, REACH, SHRINK, SLEEP_SHARE, TIMEOUT_SHARE, WirePace

MB = 1 << 20


def test_the_first_batch_is_waited_for_without_a_sleep() -> None:
    assert WirePace().sleep_before_wait(64 * MB, timeout=30) == 0.0


def test_a_batch_still_in_flight_after_the_sleep_sets_the_rate() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)  # 64 MB landed in 1 s
    assert pace.sleep_before_wait(32 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * 0.5)
    pace.observe(64 * MB, slept=SLEEP_SHARE, spun=0.05)  # faster now: 0.9 s for 64 MB
    assert pace.sleep_before_wait(64 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * 0.9)


def test_a_slower_batch_never_lengthens_the_sleep() -> None:
    """A sleep too long costs wall time, one too short only the spin: a batch slowed by a shared
    NIC or a busy core leaves the estimate at the fastest rate seen."""
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)
    pace.observe(64 * MB, slept=SLEEP_SHARE, spun=9.0)
    assert pace.sleep_before_wait(64 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * 1.0)


def test_small_batches_teach_nothing_so_their_latency_is_not_slept_through_on_a_large_one() -> None:
    """Seen on CI: a 4 KB batch that took a slow round trip set a rate that, applied to the next
    16 KB batch, slept the whole 3 s timeout and failed the write."""
    pace = WirePace()
    pace.observe(LEARN_BYTES - 1, slept=0.0, spun=0.1)
    assert pace.seconds_per_byte is None
    assert pace.sleep_before_wait(64 * MB, timeout=3.0) == 0.0


def test_a_rate_is_applied_no_further_than_reach_times_the_largest_batch_learned_from() -> None:
    pace = WirePace()
    pace.observe(LEARN_BYTES, slept=0.0, spun=0.01)
    assert pace.sleep_before_wait(1000 * LEARN_BYTES, timeout=30) == pytest.approx(SLEEP_SHARE * 0.01 * REACH)


def test_a_batch_that_landed_during_the_sleep_shrinks_the_estimate() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)
    pace.observe(64 * MB, slept=SLEEP_SHARE, spun=0.0)
    assert pace.sleep_before_wait(64 * MB, timeout=30) == pytest.approx(SLEEP_SHARE * SHRINK)


def test_short_batches_are_not_slept_through_and_no_sleep_outlasts_the_timeout() -> None:
    pace = WirePace()
    pace.observe(64 * MB, slept=0.0, spun=1.0)
    assert pace.sleep_before_wait(int(64 * MB * MIN_SLEEP / 2), timeout=30) == 0.0
    pace.observe(64 * MB * 100, slept=0.0, spun=100.0)
    assert pace.sleep_before_wait(64 * MB * 100, timeout=2.0) == TIMEOUT_SHARE * 2.0


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
