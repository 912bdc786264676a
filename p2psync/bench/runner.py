"""Runs the bench: engine ranks (see `engines`) and FSDP2 trainer ranks, synced each of the
ways (see `ways`), interleaved round by round with the gathers each way makes, timed
alone; then a verification round.

The machine's limits are measured before and after, in a process of their own, while
nothing else of the bench runs. Trainer rank 0 times every way and collects what every
rank measured. In a cluster in a box (`opts.cluster`, see `cluster`) every process joins its
node first, the link's own rate is measured beside the limits, and rank 0 reads what each
NIC sent in each step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from ..worlds import launch
from ..core.types import ParamSpec, numel
from . import broadcast, cluster, cpu, engines, fp8, limits, results, rss, verify
from .options import TRAINERS, BenchOptions
from .report import summary
from .ways import WAYS, BroadcastWay, P2PWay, Way, make_ways

if TYPE_CHECKING:
    from ..core.engine import EngineControl
    from ..core.report import UpdateReport
    from ..core.source import TrainerSource


#: Longest a member of the broadcast group waits for the next command (engines wait
#: through the p2psync updates, gathers and verifications between two of them).
GROUP_TIMEOUT = 600.0


def ways_for(opts: BenchOptions) -> list[str]:
    """The ways this run compares: those asked for, or every way the engines offer."""
    offered = [w for w in WAYS if w != "broadcast-fp32" or engines.engine_dtype(opts) is not None]
    unknown = [w for w in opts.ways if w not in offered]
    if unknown:
        raise ValueError(f"{opts.engine} engines offer the ways {offered}, not {unknown}")
    return list(opts.ways) or offered


def bench_engine(index: int, opts: BenchOptions, port: int, stop: Any) -> None:
    """Engine-rank process `index`, also a member of the broadcast group; served until `stop`."""
    cluster.join(opts.cluster, "engine", index)
    rank = engines.start_rank(index, opts, port)
    endpoint = rank.endpoint
    members = opts.engines * engines.tp(opts)
    broadcast.engine_loop(endpoint.rendezvous, index, members, endpoint.params, rank.load, stop, GROUP_TIMEOUT)
    stop.wait()
    endpoint.close()
    # Everything is closed. The interpreter's teardown of a process holding vLLM (or sglang) and
    # Mooncake can hang in native code (seen: more than the launcher's 60 s), so end it here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _controls(session: Any) -> list[EngineControl]:
    """Control clients of the session's engines, through the registry's engine targets."""
    from ..core.plugins import registry

    return [
        registry().engine_target(tables[0].engine)().control(tables, timeout=session.transfer_timeout,
                                                             token=session.token)
        for tables in session.tables.values()
    ]


def gather_plans(ways: list[Way]) -> tuple[dict[str, tuple[list[list[str]], dict[str, str]]], dict[str, str]]:
    """The distinct gatherings among the ways (buckets and dtypes), each named
    `gathers:<first way that gathers so>`, and which of them each way makes."""
    plans: dict[str, tuple[list[list[str]], dict[str, str]]] = {}
    names: dict[str, str] = {}
    of: dict[str, str] = {}
    for way in ways:
        buckets, casts = way.gathers()
        key = repr((buckets, sorted(casts.items())))
        if key not in names:
            names[key] = f"gathers:{way.name}"
            plans[names[key]] = (buckets, casts)
        of[way.name] = names[key]
    return plans, of


def _gathers_alone(
    source: TrainerSource, buckets: list[list[str]], casts: dict[str, str], progress: Callable[[], object]
) -> float:
    """Seconds of these gathers alone, from a trainer barrier (collective)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.monotonic()
    for names in buckets:
        source.gather_cast(names, {n: casts[n] for n in names if n in casts})
        progress()
    return time.monotonic() - start


def bench_trainer(rank: int, opts: BenchOptions, port: int, results: Any) -> None:
    """A trainer rank. Each round runs every way once and every distinct gathering alone,
    interleaved so that the machine's load drifts over all alike; then a verification round."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ..trainer.session import Session

    cluster.join(opts.cluster, "trainer", rank)
    rss.return_freed_memory()  # before the model exists: every way runs under the same allocator settings
    rendezvous, source = engines.start_trainer(rank, opts, port)
    ids = engines.engine_ids(opts)
    for engine in ids:  # engine ranks build their models first: wait longer than connect does
        rendezvous.read_engine(engine, timeout=GROUP_TIMEOUT)
    options = fp8.session_options(opts)  # fp8 engines: the layouts quantize with --fp8's quantizer
    session = Session(source=source, transport=opts.transport, rendezvous=rendezvous, options=options, gather="always")
    connects = {"gathering": session.connect(ids).phase_seconds}  # where each session's connect went, phase by phase
    gather_free = None
    if "gather-free" in ways_for(opts):
        gather_free = Session(source=source, transport=session.transport, rendezvous=rendezvous, options=options)
        connects["gather-free"] = gather_free.connect(ids).phase_seconds
    buckets = session.stats().buckets  # the broadcast gathers the same buckets: only the way of sending differs
    dtype = engines.engine_dtype(opts)
    members = opts.engines * engines.tp(opts)
    specs = {s.name: s for s in source.param_specs()}
    leader = None
    if rank == 0:  # fp8 engines: the broadcast quantizes what the session's layouts quantize, as they do
        quantized = fp8.quantized_for_broadcast(session, specs) if opts.fp8 else None
        leader = broadcast.Leader(rendezvous, specs, buckets, dtype, members, GROUP_TIMEOUT, quantized)
    controls = _controls(session) if rank == 0 else []
    ways = make_ways(ways_for(opts), session, source, buckets, leader, controls, dtype, gather_free)
    plans, gathers = gather_plans(ways)
    rounds = opts.warmup + opts.updates
    bar = tqdm(
        total=(rounds + 1) * sum(len(w.gathers()[0]) for w in ways) + rounds * sum(len(b) for b, _ in plans.values()),
        unit="bucket", disable=rank != 0 or not opts.progress,
    )
    progress = bar.update
    measured = Rounds(ways, list(plans))
    nics = partial(cluster.nic_bytes, opts.cluster) if opts.cluster is not None and rank == 0 else None
    busy = cpu.machine_seconds if rank == 0 else None
    for i in range(rounds):
        steps: list[tuple[str, Callable[[], float], Way | None]] = [
            (w.name, partial(w.update, progress), w) for w in ways
        ]
        steps += [(name, partial(_gathers_alone, source, *plan, progress), None) for name, plan in plans.items()]
        for name, run, way in steps:
            bar.set_description(name)
            before, sent_before = rss.reset_peak(), nics() if nics else {}
            busy_before, window_start = busy() if busy else 0.0, time.monotonic()
            took = run()
            spent = (busy() - busy_before, time.monotonic() - window_start) if busy else None
            sent = {nic: n - sent_before[nic] for nic, n in nics().items()} if nics else {}
            measured.record(name, took, way, first=i == 0, timed=i >= opts.warmup, rss_before=before, nic_bytes=sent,
                            cpu=spent)
    bar.set_description("verify")
    held = _verify(ways, leader, session, measured.broadcast_log, progress)
    bar.close()
    engine_stats = leader.stop(GROUP_TIMEOUT) if leader is not None else []
    for control in controls:
        control.close()
    measured.memory.update(
        transfer_buffers_bytes=session.stats().buffer_bytes, largest_group_bytes=session.stats().largest_group_bytes,
        bucket_bytes=opts.session.bucket_bytes, broadcast_flat_bytes=leader.flat_buffer_bytes if leader else 0,
    )
    if gather_free is not None:
        measured.memory.update({
            "gather-free_transfer_buffers_bytes": gather_free.stats().buffer_bytes,
            "gather-free_largest_group_bytes": gather_free.stats().largest_group_bytes,
        })
    p2p_ways = [w for w in ways if isinstance(w, P2PWay)]
    mine: dict[str, Any] = {
        "memory": measured.memory, "phases": measured.phases, "sent": measured.sent, "connect": connects,
        "write_intervals": {w.name: w.write_intervals[opts.warmup:rounds] for w in p2p_ways},
    }
    everyone: list[Any] = [None] * opts.trainers
    dist.all_gather_object(everyone, mine)
    dist.barrier()  # every trainer rank is done before any tears down
    transport = session.transport.describe()
    if gather_free is not None:
        gather_free.close()
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({
            "setup": _setup(opts, list(specs.values()), transport, ways),
            "ways": [{"name": w.name, **w.to_json()} for w in ways],
            "gathers_of": gathers, "seconds": measured.seconds, "per_rank": everyone, "held": held,
            "engine_stats": engine_stats, "broadcast_log": measured.broadcast_log,
            "members": [engines.member(opts, i) for i in range(members)],
            "rank_bytes": {w.name: _rank_bytes(w.reports[rounds - 1]) for w in p2p_ways},
            "payload": sum(broadcast.flat_bytes(s) for s in leader.packed) if leader else 0,
            "nic_bytes": measured.nic_bytes, "cpu": measured.cpu,
        })


def _rank_bytes(report: UpdateReport) -> dict[str, int]:
    """What each engine rank received in an update, keyed `engine/rank`."""
    return {f"{e}/{r}": n for e, er in sorted(report.engines.items()) for r, n in sorted(er.rank_bytes.items())}


def _setup(opts: BenchOptions, specs: list[ParamSpec], transport: dict[str, Any], ways: list[Way]) -> dict[str, Any]:
    return {
        "model": {
            "size": opts.size, "parameters": sum(numel(s.shape) for s in specs), "bytes": sum(s.nbytes for s in specs),
            "dtype": ",".join(sorted({s.dtype for s in specs})),
        },
        "trainers": opts.trainers,
        "trainer": opts.trainer,
        "engines": opts.engines,
        "engine": {
            "kind": opts.engine, "tp": engines.tp(opts), "dtype": engines.engine_dtype(opts) or "trainer's",
            **fp8.setup(opts),
        },
        "transport": transport,
        "updates": opts.updates,
        "warmup": opts.warmup,
        "bucket_bytes": opts.session.bucket_bytes,
        "ways": [w.name for w in ways],
        "cluster": opts.cluster.describe() if opts.cluster else None,
    }


class Rounds:
    """What one trainer rank measured over the timed rounds: seconds of every step (ways and
    gathers alone), each way's phases and bytes sent, the RSS each step added, the machine's
    CPU-seconds meanwhile (rank 0), and which way each broadcast update belonged to (the
    engines count every one; "" when untimed)."""

    def __init__(self, ways: list[Way], gather_steps: list[str]) -> None:
        self.seconds: dict[str, list[float]] = {name: [] for name in [w.name for w in ways] + gather_steps}
        self.phases: dict[str, list[dict[str, float]]] = {w.name: [] for w in ways}
        self.sent: dict[str, list[int]] = {w.name: [] for w in ways}
        self.memory: dict[str, int] = {}
        self.broadcast_log: list[str] = []
        self.nic_bytes: dict[str, list[dict[str, int]]] = {name: [] for name in self.seconds}
        self.cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in self.seconds}

    def record(
        self, step: str, took: float, way: Way | None, *, first: bool, timed: bool, rss_before: int,
        nic_bytes: dict[str, int], cpu: tuple[float, float] | None,
    ) -> None:
        """One step's result. RSS: what it added at its peak on its first run and on the worst
        later one, and what its first run left resident beyond free heap pages. `nic_bytes`: what
        each NIC of a cluster in a box sent meanwhile (empty outside one). `cpu`: the CPU-seconds
        the machine's cores spent meanwhile and the wall seconds they were counted over (the
        step's own seconds and its barrier; None where not measured)."""
        key = f"{step}_{'first' if first else 'later'}_added_bytes"
        self.memory[key] = max(self.memory.get(key, 0), rss.peak() - rss_before)
        if first:
            rss.trim()
            self.memory[f"{step}_first_kept_bytes"] = rss.now() - rss_before
        if isinstance(way, BroadcastWay):
            self.broadcast_log.append(step if timed else "")
        if timed:
            self.seconds[step].append(took)
            if nic_bytes:
                self.nic_bytes[step].append(nic_bytes)
            if cpu is not None:
                self.cpu[step].append(cpu)
            if way is not None:
                self.phases[step].append(way.phase_seconds)
                self.sent[step].append(way.sent_bytes)


def _verify(
    ways: list[Way], leader: broadcast.Leader | None, session: Any, broadcast_log: list[str],
    progress: Callable[[], object],
) -> dict[str, dict[str, str]]:
    """The untimed verification round: for each way, engines zeroed, one update (p2psync with
    its digest check), then the digest of every parameter of every engine rank (on rank 0).
    Collective over the trainer world; p2psync's check raises if it fails."""
    import torch.distributed as dist

    held = {}
    ids = list(session.tables)
    for way in ways:
        if leader is not None:
            leader.zero()
        dist.barrier()
        way.update(progress, check=True)
        if isinstance(way, BroadcastWay):
            broadcast_log.append("")
        if leader is not None:
            held[way.name] = verify.held(session.rendezvous, ids, timeout=session.transfer_timeout)
    return held


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Measure the machine's limits, every way, and the limits again (the load of a shared
    machine drifts); return the JSON-ready result.

    Raises ValueError for options the engines cannot run, RuntimeError if a process failed
    or an update left an engine stale.
    """
    if opts.engine not in engines.KINDS:
        raise ValueError(f"unknown engine kind {opts.engine!r}; choose one of {engines.KINDS}")
    if opts.size not in engines.sizes(opts.engine):
        raise ValueError(f"{opts.engine} engines run sizes {engines.sizes(opts.engine)}, not {opts.size!r}")
    if opts.trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {opts.trainer!r}; choose one of {list(TRAINERS)}")
    if opts.trainer != "fsdp2" and opts.engine == "torch":
        raise ValueError(f"the {opts.trainer} trainer runs the sglang and vLLM engines' Qwen3-MoE, not torch engines")
    ways_for(opts)
    fp8.check(opts)
    if opts.cluster is not None:
        _check_cluster(opts, opts.cluster)
        cluster.enter(opts.cluster)  # first: before any thread of this process starts
    about = {"machine": results.machine(), "versions": results.versions(opts.engine), "started": time.time()}
    before = _limits(opts)
    raw = launch(opts, bench_engine, bench_trainer, engine_processes=opts.engines * engines.tp(opts))
    after = _limits(opts)
    return {**about, **summary(raw, before, after)}


def _check_cluster(opts: BenchOptions, topology: cluster.Topology) -> None:
    """Refuse a topology whose ranks are not the bench's."""
    wanted = (topology.trainers, topology.engines, topology.tp)
    if (opts.trainers, opts.engines, engines.tp(opts)) != wanted:
        raise ValueError(
            f"topology {topology.name!r} runs {wanted[0]} trainer ranks -> {wanted[1]} engines of TP {wanted[2]}, "
            f"the bench was given {opts.trainers} -> {opts.engines} of TP {engines.tp(opts)}"
            + (" (torch engines are TP 1)" if opts.engine == "torch" else "")
        )


def _limits(opts: BenchOptions) -> dict[str, Any]:
    """The machine's limits, with the link's own rate in a cluster in a box."""
    measured = limits.measure_apart(opts.raw_bytes, opts.transport)
    if opts.cluster is not None:
        measured["raw_link"] = cluster.measure_link(opts.cluster, min(opts.raw_bytes, 128 << 20))
    return measured
