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
the tail. It learns from every batch: one that was still in flight when the sleep ended says
how long the whole batch took (sleep plus spin); one that had landed before says only that
the estimate was too long, and the estimate shrinks. Batches expected to take less than
`MIN_SLEEP` seconds are waited for by spinning alone: a sleep's own granularity would cost
more than it saves (RDMA writes of a few MB land within a millisecond).
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


@dataclass
class WirePace:
    """Seconds per byte of the writes to one peer, as far as the last batches showed."""

    seconds_per_byte: float | None = None

    def sleep_before_wait(self, nbytes: int, timeout: float) -> float:
        """Seconds to sleep before waiting for a batch of `nbytes` just submitted."""
        if self.seconds_per_byte is None:
            return 0.0
        expected = self.seconds_per_byte * nbytes
        return min(SLEEP_SHARE * expected, timeout) if expected >= MIN_SLEEP else 0.0

    def observe(self, nbytes: int, slept: float, spun: float) -> None:
        """Learn from a batch of `nbytes` that landed after `slept` seconds of sleep and `spun`
        seconds of spinning wait."""
        if nbytes <= 0:
            return
        if slept > 0 and spun < LANDED_SPIN and self.seconds_per_byte is not None:
            self.seconds_per_byte *= SHRINK  # it landed during the sleep: how early is unknown
        else:
            self.seconds_per_byte = (slept + spun) / nbytes
