"""An update as a pipeline: stages (gathers, production, wire) over chunks (buckets, transfer
buffers). A chunk enters a stage once it left the stage before and the stage finished the chunk
before it (a flow shop), so the update takes its largest stage plus the other stages' first and
last chunks: where a chunk is most of the bytes, as a transfer buffer is of a gather-free rank's
share on a small model, nothing hides behind anything. Measured in the cluster in a box
(`p2psync bench --cluster`), where `max(stages)` missed by up to 45%."""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_seconds(stages: Sequence[float], chunks: Sequence[float]) -> float:
    """Seconds for chunks (fractions of the bytes, summing to 1) to pass stages that take
    `stages` seconds for all the bytes."""
    done = [0.0] * len(stages)
    for chunk in chunks:
        ready = 0.0
        for s, seconds in enumerate(stages):
            done[s] = max(done[s], ready) + seconds * chunk
            ready = done[s]
    return done[-1] if stages else 0.0


def chunks_of(nbytes: int, chunk_bytes: int) -> list[float]:
    """`nbytes` cut into pieces of `chunk_bytes` (the last one shorter), as fractions."""
    if nbytes <= 0:
        return [1.0]
    pieces = [min(chunk_bytes, nbytes - offset) for offset in range(0, nbytes, chunk_bytes)]
    return [piece / nbytes for piece in pieces]
