"""Runs the bench: the demo's engines and FSDP2 trainer ranks, synced by p2psync and then
by the broadcast path, each timed over the same number of updates and verified.

Trainer rank 0 times both ways; the machine's limits are measured first, in a
process of their own, while nothing else of the bench runs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.types import ParamSpec, numel
from ..demo import DemoOptions, launch, start_engine, start_trainer
from . import broadcast, limits, verify
from .report import Way, summary

if TYPE_CHECKING:
    from ..core.rendezvous import Rendezvous
    from ..core.session import Session
    from ..core.source import TrainerSource


@dataclass
class BenchOptions(DemoOptions):
    """What one bench run does: the demo's model, trainers, engines and transport, plus
    untimed warm-up updates per way and the size of the raw throughput measurements."""

    warmup: int = 1
    raw_bytes: int = 512 << 20
    check: bool = False
    job_id: str = field(default_factory=lambda: f"bench-{os.getpid()}-{int(time.time())}")


def bench_engine(index: int, opts: BenchOptions, port: int, stop: Any) -> None:
    """A demo engine that also takes part in the broadcast phase; served until `stop`."""
    _, endpoint = start_engine(index, opts, port)
    broadcast.engine_loop(endpoint.rendezvous, index, opts.engines, endpoint.params, stop, opts.transfer_timeout)
    stop.wait()
    endpoint.close()


def _p2p(session: Session, opts: BenchOptions, tick: Callable[[], object]) -> Way:
    """Time `opts.updates` session updates after `opts.warmup` untimed ones."""
    import torch.distributed as dist

    seconds = []
    for i in range(opts.warmup + opts.updates):
        dist.barrier()
        report = session.update(f"bench-{i}", progress=lambda done, total: tick())
        if not report.ok:
            raise RuntimeError(report.format())
        if i >= opts.warmup:
            seconds.append(report.seconds)
    assert session.plan is not None
    return Way(
        seconds,
        {f"trainer-{rank}": nbytes for rank, nbytes in sorted(session.plan.load.items())},
        {engine: r.bytes for engine, r in sorted(report.engines.items())},
    )


def _broadcast(
    source: TrainerSource, rendezvous: Rendezvous, buckets: list[list[str]], opts: BenchOptions,
    tick: Callable[[], object],
) -> Way:
    """Time `opts.updates` broadcast updates after `opts.warmup` untimed ones."""
    import torch.distributed as dist

    rounds = opts.warmup + opts.updates
    leader = dist.get_rank() == 0
    if leader:
        broadcast.publish_order(rendezvous, buckets, rounds)
    pg = broadcast.group(rendezvous, 0, opts.engines, opts.transfer_timeout) if leader else None
    seconds = [broadcast.timed_update(source, buckets, pg, tick) for _ in range(rounds)]
    model_bytes = sum(s.nbytes for s in source.param_specs())
    return Way(
        seconds[opts.warmup :],
        {f"trainer-{r}": model_bytes * opts.engines if r == 0 else 0 for r in range(opts.trainers)},
        {f"engine-{i}": model_bytes for i in range(opts.engines)},
    )


def _setup(opts: BenchOptions, specs: list[ParamSpec], transport: dict[str, Any], gathers: list[float]) -> dict[str, Any]:
    """What was measured: model, layout, transport, counts, and the gathers' own time."""
    return {
        "model": {
            "size": opts.size,
            "parameters": sum(numel(s.shape) for s in specs),
            "bytes": sum(s.nbytes for s in specs),
            "dtype": ",".join(sorted({s.dtype for s in specs})),
        },
        "trainers": opts.trainers,
        "engines": opts.engines,
        "transport": {"name": transport["transport"], "protocol": transport.get("protocol", "-")},
        "updates": opts.updates,
        "warmup": opts.warmup,
        "bucket_bytes": opts.bucket_bytes,
        "gather_seconds": statistics.median(gathers),
    }


def bench_trainer(rank: int, opts: BenchOptions, port: int, results: Any) -> None:
    """A demo trainer rank that syncs by p2psync, then by broadcast, verifying each, then
    times the FSDP2 gathers alone (what both ways pay before sending)."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ..adapters.fsdp2 import FSDP2Source
    from ..core.session import Session

    rendezvous, model = start_trainer(rank, opts, port)
    source = FSDP2Source(model)
    engines = [f"engine-{i}" for i in range(opts.engines)]
    session = Session(
        source=source, transport=opts.transport, rendezvous=rendezvous, bucket_bytes=opts.bucket_bytes,
        transfer_timeout=opts.transfer_timeout, check=opts.check,
    )
    session.connect(engines)
    buckets = broadcast.buckets_of(source, opts.bucket_bytes)
    rounds = opts.warmup + opts.updates
    bar = tqdm(
        total=rounds * (session.bucket_count + 2 * len(buckets)), unit="bucket", disable=rank != 0 or not opts.progress
    )

    def check(way: Way) -> Way:
        way.mismatches = verify.mismatches(
            source, buckets, rendezvous, engines, is_caller=rank == 0, timeout=opts.transfer_timeout
        )
        return way

    bar.set_description("p2p")
    p2p = check(_p2p(session, opts, bar.update))
    transport = session.transport.describe()
    session.close()
    bar.set_description("broadcast")
    ways = {"p2p": p2p, "broadcast": check(_broadcast(source, rendezvous, buckets, opts, bar.update))}
    bar.set_description("gathers alone")
    gathers = [broadcast.timed_update(source, buckets, None, bar.update) for _ in range(rounds)]
    bar.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"setup": _setup(opts, source.param_specs(), transport, gathers[opts.warmup :]), "ways": ways})


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Measure the machine's limits, then both ways; return the JSON-ready result.

    Raises RuntimeError if a process failed or an update left an engine stale.
    """
    machine = limits.measure_apart(opts.raw_bytes, opts.transport)
    outcome = launch(opts, bench_engine, bench_trainer)
    return summary(outcome["setup"], outcome["ways"], machine)
