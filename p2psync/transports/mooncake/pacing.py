"""Sleep through most of a Mooncake write instead of spinning a core for all of it.

`get_batch_transfer_status`, the only call that tells when every write of a batch has landed,
polls in a loop without sleeping: the waiting thread takes a whole core for as long as the
batch is on the wire (measured over a 0.5 Gbit/s link: 0.53 CPU-s for a 0.53 s write). A
trainer rank waits on one such call per engine it writes to at once, so the spin competes
with its gathers and its production, and on a trainer node with many engines it takes cores
the trainer's own work needs. The non-blocking `transfer_check_status` looks at the batch's
first write only, so it cannot replace the wait.

`WirePace` learns, per peer, how long a byte takes to land, and has the writer sleep for most
of the next batch's expected time before it enters the spinning wait, which then only covers
the tail. An estimate that is too long costs wall time (the writer sleeps past the landing),
one that is too short only costs the spin, so the estimate errs short: it is the fastest rate
a batch of at least `LEARN_BYTES` showed (a smaller batch's time is mostly fixed latency, and
its rate applied to a large batch once slept a whole timeout away), and a batch that landed
before the sleep ended shrinks it. A batch larger than `REACH` times the largest one learned
from is slept through as if it were that large: the rate of a small batch, whose latency
weighs more, is not stretched over a far larger one. A slower batch (a shared NIC, a busy
core) never lengthens the sleep. No sleep is longer than `TIMEOUT_SHARE` of the write's timeout, so the estimate
alone can never make a write late. Batches expected to take less than `MIN_SLEEP` seconds are
waited for by spinning alone: a sleep's own granularity would cost more than it saves (RDMA
writes of a few MB land within a millisecond).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The share of a batch's expected wire time slept before spinning: the estimate may be long
#: by up to 1 / SLEEP_SHARE - 1 before a sleep outlasts the write.
SLEEP_SHARE = 0.85
#: Expected wire times below this are not slept through.
MIN_SLEEP = 1e-3
#: A spin shorter than this after the sleep means the batch had already landed.
LANDED_SPIN = 2e-4
#: How much the estimate shrinks when a batch landed before the sleep ended.
SHRINK = 0.8
#: Batches smaller than this teach nothing: their time is mostly latency, not wire.
LEARN_BYTES = 1 << 20
#: How far past the largest batch learned from an estimate is applied.
REACH = 4
#: The longest sleep, as a share of the write's timeout.
TIMEOUT_SHARE = 0.5


@dataclass
class WirePace:
    """Seconds per byte of the writes to one peer: the fastest the batches so far showed."""

    seconds_per_byte: float | None = None
    #: The largest batch learned from.
    learned_bytes: int = 0

    def sleep_before_wait(self, nbytes: int, timeout: float) -> float:
        """Seconds to sleep before waiting for a batch of `nbytes` just submitted."""
        if self.seconds_per_byte is None:
            return 0.0
        expected = self.seconds_per_byte * min(nbytes, REACH * self.learned_bytes)
        return min(SLEEP_SHARE * expected, TIMEOUT_SHARE * timeout) if expected >= MIN_SLEEP else 0.0

    def observe(self, nbytes: int, slept: float, spun: float) -> None:
        """Learn from a batch of `nbytes` that landed after `slept` seconds of sleep and `spun`
        seconds of spinning wait."""
        if nbytes < LEARN_BYTES:
            return
        self.learned_bytes = max(self.learned_bytes, nbytes)
        if slept > 0 and spun < LANDED_SPIN and self.seconds_per_byte is not None:
            self.seconds_per_byte *= SHRINK  # it landed during the sleep: how early is unknown
        else:
            seen = (slept + spun) / nbytes
            self.seconds_per_byte = seen if self.seconds_per_byte is None else min(self.seconds_per_byte, seen)
