"""An update as a pipeline: stages (gathers, production, wire) over chunks (buckets, transfer
buffers). A chunk enters a stage once it left the stage before and the stage finished the chunk
before it (a flow shop), so the update takes its largest stage plus the other stages' first and
last chunks: where a chunk is most of the bytes, as a transfer buffer is of a gather-free rank's
share on a small model, nothing hides behind anything. Measured in the cluster in a box
(`p2psync bench --cluster`), where `max(stages)` missed by up to 45%."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Step:
    """One chunk's pass through a stage: `resource` (the stage: a resource serves one chunk at a
    time, in the chunks' order), its `seconds` with every core it wants, and the `cpu_seconds`
    it spends (0 for a wire's own time)."""

    resource: str
    seconds: float
    cpu_seconds: float = 0.0

    def scaled(self, share: float) -> Step:
        """This step for `share` of its bytes."""
        return Step(self.resource, self.seconds * share, self.cpu_seconds * share)


def shared_seconds(jobs: Sequence[Sequence[Step]], cores: float) -> float:
    """Seconds for `jobs` (chunks, each a route of steps) to pass their stages as a flow shop
    whose stages share `cores` cores: each chunk enters its first stage once the chunk before it
    left its own first one (one thread feeds the pipeline, as an update's main loop does), each
    stage serves one chunk at a time in order, and where the steps running at once want more
    cores than there are, each gets a fair share (max-min) and slows by what it lacks.

    With cores to spare this is `pipeline_seconds`; with none, the CPU-seconds over the cores
    plus the pipeline's fill and drain, where fewer stages run. Measured in the cluster in a
    box, where two cores serve every node: a way whose stages each fit but whose CPU-seconds
    nearly fill the cores took up to 1.35x the larger of the two accounts."""
    queue: dict[str, list[int]] = {}
    for j, job in enumerate(jobs):
        for step in job:
            queue.setdefault(step.resource, []).append(j)
    at = [0] * len(jobs)  # each job's current step
    left = [1.0] * len(jobs)  # the share of that step still to run
    now = 0.0

    def finish(j: int) -> None:
        queue[jobs[j][at[j]].resource].pop(0)
        at[j] += 1
        left[j] = 1.0

    while True:
        entered = next((j for j, step in enumerate(at) if step == 0), len(jobs))  # the next to enter
        running = [
            j for j, job in enumerate(jobs)
            if at[j] < len(job) and queue[job[at[j]].resource][0] == j and (at[j] > 0 or j == entered)
        ]
        if not running:
            return now
        steps = {j: jobs[j][at[j]] for j in running}
        instant = [j for j, step in steps.items() if step.seconds <= 0]
        for j in instant:  # nothing to wait for
            finish(j)
        if instant:
            continue
        speed = _fair_speeds({j: step.cpu_seconds / step.seconds for j, step in steps.items()}, cores)
        dt = min(left[j] * steps[j].seconds / speed[j] for j in running)
        now += dt
        for j in running:
            left[j] -= dt * speed[j] / steps[j].seconds
            if left[j] <= 1e-9:
                finish(j)


def _fair_speeds(wants: dict[int, float], cores: float) -> dict[int, float]:
    """Each step's speed (1: as fast as with every core it wants) when steps wanting `wants`
    cores share `cores` max-min fairly."""
    speed, spare, waiting = {}, cores, sorted(wants, key=wants.__getitem__)
    for n, j in enumerate(waiting):
        share = spare / (len(waiting) - n)
        got = min(wants[j], share)
        speed[j] = got / wants[j] if wants[j] > 0 else 1.0
        spare -= got
    return speed
