"""Runs the bench: engine ranks (see `engines`) and FSDP2 trainer ranks, synced by p2psync
and by the broadcast path, interleaved round by round and timed, then verified.

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
from ..conformance.harness import launch
from ..demo import DemoOptions
from . import broadcast, engines, limits, rss, verify
from .report import Way, summary, writing_seconds

if TYPE_CHECKING:
    from ..core.report import UpdateReport
    from ..core.session import Session
    from ..core.source import TrainerSource


@dataclass
class BenchOptions(DemoOptions):
    """What one bench run does: the demo's model, trainers, engines and transport, the engine
    kind (`engines.KINDS`) and its ranks per engine, untimed warm-up updates per way and
    the size of the raw throughput measurements."""

    engine: str = "torch"
    engine_tp: int = 2
    warmup: int = 1
    raw_bytes: int = 512 << 20
    check: bool = False
    job_id: str = field(default_factory=lambda: f"bench-{os.getpid()}-{int(time.time())}")


#: Longest a member of the broadcast group waits for the next command (engines wait
#: through the p2psync updates, gathers and verifications between two of them).
GROUP_TIMEOUT = 600.0


def bench_engine(index: int, opts: BenchOptions, port: int, stop: Any) -> None:
    """Engine-rank process `index`, also a member of the broadcast path; served until `stop`."""
    rank = engines.start_rank(index, opts, port)
    endpoint = rank.endpoint
    members = opts.engines * engines.tp(opts)
    broadcast.engine_loop(endpoint.rendezvous, index, members, endpoint.params, rank.load, stop, GROUP_TIMEOUT)
    stop.wait()
    endpoint.close()


def _setup(
    opts: BenchOptions, specs: list[ParamSpec], transport: dict[str, Any], gathers: list[float]
) -> dict[str, Any]:
    """What was measured: model, layouts, transport, counts, and the gathers' own time."""
    return {
        "model": {
            "size": opts.size,
            "parameters": sum(numel(s.shape) for s in specs),
            "bytes": sum(s.nbytes for s in specs),
            "dtype": ",".join(sorted({s.dtype for s in specs})),
        },
        "trainers": opts.trainers,
        "engines": opts.engines,
        "engine": {"kind": opts.engine, "tp": engines.tp(opts), "dtype": engines.broadcast_dtype(opts) or "trainer's"},
        "transport": {"name": transport["transport"], "protocol": transport.get("protocol", "-")},
        "updates": opts.updates,
        "warmup": opts.warmup,
        "bucket_bytes": opts.bucket_bytes,
        "gather_seconds": statistics.median(gathers),
    }


def bench_trainer(rank: int, opts: BenchOptions, port: int, results: Any) -> None:
    """A trainer rank. Each round runs one p2psync update, one broadcast update and the
    FSDP2 gathers alone (what both ways pay), interleaved so that the machine's load
    drifts over all three alike. A last, untimed round verifies: engines zeroed, a
    p2psync update with its digest check, the digests of every engine parameter; engines
    zeroed again, a broadcast update, and every parameter must hold the same bytes."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ..core.session import Session

    rss.return_freed_memory()  # before the model exists: both ways run under the same allocator settings
    rendezvous, source = engines.start_trainer(rank, opts, port)
    ids = engines.engine_ids(opts)
    for engine in ids:  # engine ranks build their models first: wait longer than connect does
        rendezvous.read_engine(engine, timeout=GROUP_TIMEOUT)
    session = Session(
        source=source, transport=opts.transport, rendezvous=rendezvous, bucket_bytes=opts.bucket_bytes,
        transfer_timeout=opts.transfer_timeout, check=opts.check,
    )
    session.connect(ids)
    buckets = broadcast.buckets_of(source, opts.bucket_bytes)
    dtype = engines.broadcast_dtype(opts)
    members = opts.engines * engines.tp(opts)
    pg = broadcast.leader_group(rendezvous, source, buckets, dtype, members, GROUP_TIMEOUT) if rank == 0 else None
    rounds = opts.warmup + opts.updates
    bar = tqdm(
        total=(rounds + 1) * (session.bucket_count + len(buckets)) + rounds * len(buckets), unit="bucket",
        disable=rank != 0 or not opts.progress,
    )
    reports: list[UpdateReport] = []
    writes: list[list[tuple[float, float]]] = []  # per update, when this rank's writes ran

    def p2p() -> float:
        dist.barrier()
        reports.append(session.update(f"bench-{len(reports)}", progress=lambda done, total: bar.update()))
        if not reports[-1].ok:
            raise RuntimeError(reports[-1].format())
        writes.append(session.write_intervals)
        return reports[-1].seconds

    steps: dict[str, Callable[[], float]] = {
        "p2p": p2p,
        "broadcast": lambda: broadcast.timed_update(source, buckets, pg, bar.update, dtype),
        "gathers": lambda: broadcast.timed_update(source, buckets, None, bar.update),
    }
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    # RSS each way's update adds: its first (touching its buffers first), and the most of any later one
    memory: dict[str, int] = {}
    for i in range(rounds):
        for name, step in steps.items():
            bar.set_description(name)
            before = rss.reset_peak()
            seconds[name].append(step())
            key = f"{name}_{'first' if i == 0 else 'later'}_added_bytes"
            memory[key] = max(memory.get(key, 0), rss.peak() - before)
            if i == 0:
                memory[f"{name}_first_kept_bytes"] = rss.now() - before  # still resident after it
    bar.set_description("verify")
    wrong = _verify(session, source, buckets, pg, p2p, dtype, bar.update, rank == 0)
    bar.close()
    if pg is not None:
        broadcast.stop(pg)
    memory.update(
        transfer_buffers_bytes=session.buffer_bytes,
        largest_group_bytes=session.largest_group_bytes,
        bucket_bytes=opts.bucket_bytes,
    )
    memories = [None] * opts.trainers
    dist.all_gather_object(memories, memory)
    sent: list[int] = [0] * opts.trainers
    dist.all_gather_object(sent, session.sent_bytes)
    all_writes: list[Any] = [None] * opts.trainers
    dist.all_gather_object(all_writes, writes[opts.warmup : rounds])
    dist.barrier()  # every trainer rank is done before any tears down
    transport = session.transport.describe()
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        timed = {name: s[opts.warmup :] for name, s in seconds.items()}
        specs = source.param_specs()
        ways = _ways(opts, timed, sent, reports[-1], wrong, broadcast.sent_bytes(source, dtype))
        setup = _setup(opts, specs, transport, timed["gathers"])
        setup["trainer_memory"] = {f"trainer-{r}": m for r, m in enumerate(memories)}
        setup["p2p_writing_seconds"] = [
            writing_seconds([i for rank in all_writes for i in rank[k]]) for k in range(opts.updates)
        ]
        results.put({"setup": setup, "ways": ways})


def _verify(
    session: Session, source: TrainerSource, buckets: list[list[str]], pg: Any | None, p2p: Callable[[], float],
    dtype: str | None, progress: Callable[[], object], is_leader: bool,
) -> dict[str, list[str]]:
    """The untimed verification round (see `bench_trainer`); the parameters each way got wrong.
    p2psync's bytes must equal what each engine rank's own loader makes of the trainer's full
    tensors (the broadcast path): a parameter where the two differ counts against both ways,
    neither being then known right. Collective over the trainer world; p2psync's check raises
    if it fails."""
    import torch.distributed as dist

    ids = list(session.tables)
    timeout = session.transfer_timeout
    if pg is not None:
        broadcast.zero(pg)
    checking, session.check = session.check, True
    p2p()
    session.check = checking
    from_p2p = verify.held(session.rendezvous, ids, timeout=timeout) if is_leader else {}
    if pg is not None:
        broadcast.zero(pg)
    dist.barrier()
    broadcast.send_update(source, buckets, pg, progress, dtype)
    from_loaders = verify.held(session.rendezvous, ids, timeout=timeout) if is_leader else {}
    differ = verify.mismatches(from_loaders, from_p2p)
    return {"p2p": differ, "broadcast": differ}


def _ways(
    opts: BenchOptions, timed: dict[str, list[float]], sent: list[int], last: UpdateReport,
    wrong: dict[str, list[str]], model_bytes: int,
) -> dict[str, Way]:
    """Both ways' results. p2psync's bytes are what each trainer rank wrote and what each
    engine rank received in its last update; the broadcast delivers the whole model (in
    the dtype it sends, `model_bytes`) to every engine rank, sent by trainer rank 0 and,
    past two engine ranks, relayed by some of them."""
    ranks = [engines.member(opts, i) for i in range(opts.engines * engines.tp(opts))]
    names = [f"{engine}/{rank}" for engine, rank in ranks]
    sends = broadcast.sends_per_member(1 + len(ranks))
    broadcast_senders = {f"trainer-{r}": sends[0] * model_bytes if r == 0 else 0 for r in range(opts.trainers)}
    broadcast_senders.update({f"{name} (relay)": n * model_bytes for name, n in zip(names, sends[1:]) if n})
    return {
        "p2p": Way(
            timed["p2p"],
            {f"trainer-{r}": nbytes for r, nbytes in enumerate(sent)},
            {f"{engine}/{rank}": last.engines[engine].rank_bytes.get(rank, 0) for engine, rank in ranks},
            wrong["p2p"],
        ),
        "broadcast": Way(timed["broadcast"], broadcast_senders, dict.fromkeys(names, model_bytes), wrong["broadcast"]),
    }


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Measure the machine's limits, both ways, and the limits again (the load of a shared
    machine drifts); return the JSON-ready result.

    Raises RuntimeError if a process failed or an update left an engine stale.
    """
    if opts.engine not in engines.KINDS:
        raise ValueError(f"unknown engine kind {opts.engine!r}; choose one of {engines.KINDS}")
    if opts.size not in engines.sizes(opts.engine):
        raise ValueError(f"{opts.engine} engines run sizes {engines.sizes(opts.engine)}, not {opts.size!r}")
    before = limits.measure_apart(opts.raw_bytes, opts.transport)
    outcome = launch(opts, bench_engine, bench_trainer, engine_processes=opts.engines * engines.tp(opts))
    after = limits.measure_apart(opts.raw_bytes, opts.transport)
    return summary(outcome["setup"], outcome["ways"], before, after)
