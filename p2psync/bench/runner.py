"""Runs the bench: the demo's engines and FSDP2 trainer ranks, synced by p2psync and by
the broadcast path, interleaved round by round, each timed and verified.

Trainer rank 0 times both ways; the machine's limits are measured first, in a
process of their own, while nothing else of the bench runs.
"""

from __future__ import annotations

import os
import resource
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
    from ..core.report import UpdateReport


@dataclass
class BenchOptions(DemoOptions):
    """What one bench run does: the demo's model, trainers, engines and transport, plus
    untimed warm-up updates per way and the size of the raw throughput measurements."""

    warmup: int = 1
    raw_bytes: int = 512 << 20
    check: bool = False
    job_id: str = field(default_factory=lambda: f"bench-{os.getpid()}-{int(time.time())}")


#: Longest a member of the broadcast group waits for the next command (engines wait
#: through the p2psync updates, gathers and verifications between two of them).
GROUP_TIMEOUT = 600.0


def bench_engine(index: int, opts: BenchOptions, port: int, stop: Any) -> None:
    """A demo engine that also takes part in the broadcast path; served until `stop`."""
    _, endpoint = start_engine(index, opts, port)
    broadcast.engine_loop(endpoint.rendezvous, index, opts.engines, endpoint.params, stop, GROUP_TIMEOUT)
    stop.wait()
    endpoint.close()


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _setup(
    opts: BenchOptions, specs: list[ParamSpec], transport: dict[str, Any], gathers: list[float]
) -> dict[str, Any]:
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
    """A demo trainer rank. Each round runs one p2psync update, one broadcast update and
    the FSDP2 gathers alone (what both ways pay), interleaved so that the machine's load
    drifts over all three alike. Before the last update of each way the engines zero
    their parameters, and after it they must hold the trainer's bytes."""
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
    held_before = _peak_rss()  # model, transport libraries, untouched buffers: what syncing starts from
    buckets = broadcast.buckets_of(source, opts.bucket_bytes)
    pg = broadcast.leader_group(rendezvous, buckets, opts.engines, GROUP_TIMEOUT) if rank == 0 else None
    rounds = opts.warmup + opts.updates
    bar = tqdm(
        total=rounds * (session.bucket_count + 2 * len(buckets)), unit="bucket", disable=rank != 0 or not opts.progress
    )
    reports: list[UpdateReport] = []

    def p2p() -> float:
        dist.barrier()
        reports.append(session.update(f"bench-{len(reports)}", progress=lambda done, total: bar.update()))
        if not reports[-1].ok:
            raise RuntimeError(reports[-1].format())
        return reports[-1].seconds

    steps: dict[str, Callable[[], float]] = {
        "p2p": p2p,
        "broadcast": lambda: broadcast.timed_update(source, buckets, pg, bar.update),
        "gathers": lambda: broadcast.timed_update(source, buckets, None, bar.update),
    }
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    wrong: dict[str, list[str]] = {}
    for i in range(rounds):
        for name, step in steps.items():
            bar.set_description(name)
            last = i == rounds - 1 and name != "gathers"
            if last and pg is not None:
                broadcast.zero(pg)
            seconds[name].append(step())
            if last:
                wrong[name] = verify.mismatches(
                    source, buckets, rendezvous, engines, is_caller=rank == 0, timeout=opts.transfer_timeout
                )
    bar.close()
    if pg is not None:
        broadcast.stop(pg)
    memory = {
        "before_sync_bytes": held_before,
        "peak_bytes": _peak_rss(),
        "transfer_buffers_bytes": session.buffer_bytes,
        "largest_group_bytes": session.largest_group_bytes,
        "bucket_bytes": opts.bucket_bytes,
    }
    memories = [None] * opts.trainers
    dist.all_gather_object(memories, memory)
    dist.barrier()  # every trainer rank is done before any tears down
    transport = session.transport.describe()
    assert session.plan is not None
    load = session.plan.load
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        timed = {name: s[opts.warmup :] for name, s in seconds.items()}
        specs = source.param_specs()
        ways = _ways(opts, specs, timed, load, reports[-1], wrong)
        setup = _setup(opts, specs, transport, timed["gathers"])
        setup["trainer_memory"] = {f"trainer-{r}": m for r, m in enumerate(memories)}
        results.put({"setup": setup, "ways": ways})


def _ways(
    opts: BenchOptions, specs: list[ParamSpec], timed: dict[str, list[float]], load: dict[int, int],
    last: UpdateReport, wrong: dict[str, list[str]],
) -> dict[str, Way]:
    """Both ways' results. p2psync's bytes are what its plan gave each sender and what
    its last update wrote to each engine; the broadcast delivers the whole model to
    every engine, sent by trainer rank 0 and, past two engines, relayed by some engines."""
    model_bytes = sum(s.nbytes for s in specs)
    engines = [f"engine-{i}" for i in range(opts.engines)]
    sends = broadcast.sends_per_member(1 + opts.engines)
    broadcast_senders = {f"trainer-{r}": sends[0] * model_bytes if r == 0 else 0 for r in range(opts.trainers)}
    broadcast_senders.update({f"{e} (relay)": n * model_bytes for e, n in zip(engines, sends[1:]) if n})
    return {
        "p2p": Way(
            timed["p2p"],
            {f"trainer-{r}": nbytes for r, nbytes in sorted(load.items())},
            {engine: e.bytes for engine, e in sorted(last.engines.items())},
            wrong["p2p"],
        ),
        "broadcast": Way(
            timed["broadcast"],
            broadcast_senders,
            dict.fromkeys(engines, model_bytes),
            wrong["broadcast"],
        ),
    }


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Measure the machine's limits, then both ways; return the JSON-ready result.

    Raises RuntimeError if a process failed or an update left an engine stale.
    """
    machine = limits.measure_apart(opts.raw_bytes, opts.transport)
    outcome = launch(opts, bench_engine, bench_trainer)
    return summary(outcome["setup"], outcome["ways"], machine)
