"""`p2psync bench --delta`: delta updates against full ones and the broadcast path, with real
optimizer steps between updates.

The trainer (FSDP2 ranks of the demo's dense Qwen3) takes AdamW steps on the causal-LM
loss of random tokens, at each learning rate in turn; after every step each way updates
the engines (torch engines holding bfloat16, as inference engines serve): p2psync in
delta mode, p2psync's full update (a session of its own) and the broadcast path, in that
order, so all three write the same bytes of the same step and the load of the shared
machine drifts over all alike. Per learning rate: the fraction of elements that changed
per step, the bytes each engine rank received (delta against full), each way's median
time, and the memory the senders hold for delta mode. A last step verifies: a delta
update with p2psync's digest check, then every parameter of every engine rank must
equal what a full update of the same step leaves.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..trainer import collectives
from ..core.types import numel
from . import broadcast, cluster, engines, results, rss, verify
from .runner import GROUP_TIMEOUT, BenchOptions, _check_cluster, _controls, _limits, bench_engine
from .ways import BroadcastWay, P2PWay, Way

if TYPE_CHECKING:
    from ..worlds.models import Trainer
    from ..trainer.session import Session

WAYS = ("p2p-delta", "p2p-delta-unproven", "p2p", "broadcast")
#: The engines' dtype in delta runs unless given: float32 engines see nearly every element change.
DELTA_ENGINE_DTYPE = "bfloat16"


def _sessions(opts: BenchOptions, source: Any, rendezvous: Any) -> tuple[Session, Session, Session]:
    """The delta session (sending as `opts.session.gather` says), the same with its engines'
    baselines taken on trust (`prove_baselines=False`: what the proof costs), and the full
    one, which gathers: the broadcast gathers its buckets."""
    from ..trainer.options import SessionOptions
    from ..trainer.session import Session

    def make(delta: bool | dict[str, bool], options: SessionOptions) -> Session:
        return Session(source=source, transport=opts.transport, rendezvous=rendezvous, options=options, delta=delta)

    return (make(True, opts.session), make({"prove_baselines": False}, opts.session),
            make(False, SessionOptions.of(opts.session, gather="always")))


def _measure(way: Way, progress: Callable[[], object]) -> dict[str, Any]:
    """One timed update of `way`, with the peak RSS it added on this rank and, for p2psync,
    its report's bytes per engine rank and changed fraction."""
    before = rss.reset_peak()
    seconds = way.update(progress)
    out: dict[str, Any] = {"seconds": seconds, "added_bytes": rss.peak() - before}
    if isinstance(way, P2PWay):
        report = way.reports[-1]
        out["rank_bytes"] = {
            f"{e}/{r}": n for e, er in sorted(report.engines.items()) for r, n in er.rank_bytes.items()
        }
        out["delta_ranks"] = sum(len(er.delta_ranks) for er in report.engines.values())
        out["changed"], out["compared"] = report.changed_elements, report.compared_elements
        out["delta_memory_bytes"] = report.delta_memory_bytes
        out["phases"] = way.phase_seconds
    return out


def delta_trainer(rank: int, opts: BenchOptions, port: int, results: Any) -> None:
    """A trainer rank of `p2psync bench --delta` (see the module's docstring)."""
    from ..adapters.fsdp2 import FSDP2Source
    from ..worlds import start_fsdp2
    from ..worlds.models import Trainer

    cluster.join(opts.cluster, "trainer", rank)
    rss.return_freed_memory()
    rendezvous, model = start_fsdp2(rank, engines.torch_world(opts), port)
    source = FSDP2Source(model)
    ids = engines.engine_ids(opts)
    for engine in ids:
        rendezvous.read_engine(engine, timeout=GROUP_TIMEOUT)
    delta, unproven, full = _sessions(opts, source, rendezvous)
    for session in (delta, unproven, full):
        session.connect(ids)
    buckets = full.stats().buckets  # the broadcast gathers the same buckets
    specs = {s.name: s for s in source.param_specs()}
    leader, controls = None, []
    if rank == 0:
        leader = broadcast.Leader(rendezvous, specs, buckets, opts.engine_dtype, opts.engines, GROUP_TIMEOUT)
        controls = _controls(full)
    ways: list[Way] = [
        P2PWay(delta, "p2p-delta", "p2psync, delta mode"),
        P2PWay(full, "p2p", "p2psync, full update"),
        P2PWay(unproven, "p2p-delta-unproven", "p2psync, delta mode, the engines' baselines not proven"),
        BroadcastWay("broadcast", "broadcast, gathers cast to the engines' dtype", source, buckets, leader,
                     opts.engine_dtype, controls, full.update_lease),
    ]

    per_lr: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for lr in opts.delta_lrs:
        trainer = Trainer(model, seed=rank, lr=lr)  # data parallel: each rank its own batches
        rounds: dict[str, list[dict[str, Any]]] = {w.name: [] for w in ways}
        for i in range(opts.warmup + opts.updates):
            trainer.step()
            for way in ways:
                measured = _measure(way, _nothing)
                if i >= opts.warmup:
                    rounds[way.name].append(measured)
        per_lr[f"{lr:g}"] = rounds
    mismatches = _verify(trainer, ways, rendezvous, ids, opts.session.transfer_timeout, rank == 0)
    stats = delta.stats()
    held = collectives.all_gather({
        "delta_bytes": stats.delta_bytes, "baseline_bytes": stats.baseline_bytes,
        "patch_buffer_bytes": stats.patch_buffer_bytes, "gather_free_bytes": stats.gather_free_bytes[0],
        "buffer_bytes": full.stats().buffer_bytes,
    })
    if leader is not None:
        leader.stop(GROUP_TIMEOUT)
    for control in controls:
        control.close()
    for session in (delta, unproven, full):
        session.close()
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put({
            "per_lr": per_lr, "mismatches": mismatches, "trainer_memory": held,
            "parameters": sum(numel(s.shape) for s in specs.values()),
        })


def _nothing() -> None:
    return None


def _verify(
    trainer: Trainer, ways: list[Way], rendezvous: Any, ids: list[str], timeout: float, leader: bool
) -> list[str]:
    """One more step: a delta update with p2psync's digest check (raises if it fails), then the
    engines' digests, a full update of the same step, and the digests again; the parameters
    that differ (on trainer rank 0; empty elsewhere)."""
    delta_way, full_way = ways[0], ways[1]
    trainer.step()
    delta_way.update(_nothing, check=True)
    after_delta = verify.held(rendezvous, ids, timeout=timeout) if leader else {}
    full_way.update(_nothing, check=True)
    after_full = verify.held(rendezvous, ids, timeout=timeout) if leader else {}
    return sorted(k for k in after_full if after_delta.get(k) != after_full[k])


def summarize(raw: Mapping[str, Any], opts: BenchOptions, load: tuple[list[float], list[float]]) -> dict[str, Any]:
    """Per learning rate: changed fraction, bytes per engine rank (delta, full, their ratio),
    each way's median seconds and the ratios of medians; the senders' delta memory."""
    out: dict[str, Any] = {}
    for lr, rounds in raw["per_lr"].items():
        delta, full = rounds["p2p-delta"], rounds["p2p"]
        per_rank_delta = {k: statistics.median(r["rank_bytes"][k] for r in delta) for k in delta[0]["rank_bytes"]}
        per_rank_full = {k: statistics.median(r["rank_bytes"][k] for r in full) for k in full[0]["rank_bytes"]}
        seconds = {name: statistics.median(r["seconds"] for r in rs) for name, rs in rounds.items()}
        out[lr] = {
            "changed_fraction": statistics.median(r["changed"] / r["compared"] for r in delta if r["compared"]),
            "delta_updates": [r["delta_ranks"] for r in delta],
            "bytes_per_engine_rank": {"delta": per_rank_delta, "full": per_rank_full},
            "full_over_delta_bytes": min(per_rank_full[k] / max(per_rank_delta[k], 1) for k in per_rank_full),
            "seconds": seconds,
            "seconds_all": {name: [r["seconds"] for r in rs] for name, rs in rounds.items()},
            "full_over_delta_seconds": seconds["p2p"] / seconds["p2p-delta"],
            "proof_fraction": seconds["p2p-delta"] / seconds["p2p-delta-unproven"] - 1,
            "broadcast_over_delta_seconds": seconds["broadcast"] / seconds["p2p-delta"],
            "peak_added_bytes": {name: max(r["added_bytes"] for r in rs) for name, rs in rounds.items()},
            "trainer0_phases": {
                name: _median_phases([r["phases"] for r in rounds[name]])
                for name in ("p2p-delta", "p2p-delta-unproven", "p2p")
            },
        }
    return {
        "setup": {
            "model": {"size": opts.size, "parameters": raw["parameters"]}, "trainers": opts.trainers,
            "engines": opts.engines, "engine": {"kind": opts.engine, "dtype": opts.engine_dtype},
            "transport": opts.transport, "updates": opts.updates, "warmup": opts.warmup,
            "learning_rates": list(raw["per_lr"]), "gather": opts.session.gather,
        },
        "per_lr": out,
        "verified": not raw["mismatches"],
        "mismatches": raw["mismatches"][:10],
        "trainer_memory": {f"trainer-{r}": m for r, m in enumerate(raw["trainer_memory"])},
        "load_average": {"before": load[0], "after": load[1]},
    }


def _median_phases(updates: list[dict[str, float]]) -> dict[str, float]:
    return {p: statistics.median(u.get(p, 0.0) for u in updates) for p in sorted({p for u in updates for p in u})}


def run_delta_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run `p2psync bench --delta` (torch engines); the JSON-ready result.

    Raises ValueError for options it cannot run, RuntimeError if a process failed."""
    from ..worlds import launch

    if opts.engine != "torch":
        raise ValueError("--delta runs torch engines (its trainer takes real steps on the dense Qwen3 model)")
    if opts.warmup < 1:
        raise ValueError("--delta needs a warm-up update (the first one is full: it seeds the baselines)")
    if opts.engine_dtype is None:
        opts.engine_dtype = DELTA_ENGINE_DTYPE
    link: dict[str, Any] = {}
    if opts.cluster is not None:  # the link's own rate, measured before and after
        _check_cluster(opts, opts.cluster)
        cluster.enter(opts.cluster)  # first: before any thread of this process starts
        link["before"] = _limits(opts)["raw_link"]
    started, before = time.time(), list(os.getloadavg())
    raw = launch(opts, bench_engine, delta_trainer, engine_processes=opts.engines)
    result = {"started": started, "machine": results.machine(), **summarize(raw, opts, (before, list(os.getloadavg())))}
    if opts.cluster is not None:
        link["after"] = _limits(opts)["raw_link"]
        result["setup"]["cluster"] = {**opts.cluster.describe(), "raw_link": link}
    return result


def format_delta(result: Mapping[str, Any]) -> str:
    """The delta run as text."""
    s = result["setup"]
    load = result["load_average"]
    box = s.get("cluster")
    lines = [
        *([f"in a cluster in a box, topology {box['name']}: {box['trainer_nodes']} trainer ranks per node -> "
           f"{box['engines']} engines, each on its node; link {box['link_gbit']:g} Gbit/s per NIC (measured "
           f"{box['raw_link']['before']['gbps'] * 8:.2f} before, {box['raw_link']['after']['gbps'] * 8:.2f} after)"]
          if box else []),
        f"delta updates: model {s['model']['size']} ({s['model']['parameters']:,} parameters), {s['trainers']} FSDP2 "
        f"trainer ranks taking AdamW steps -> {s['engines']} torch engines ({s['engine']['dtype']}) over "
        f"{s['transport']} (the delta session's gather={s.get('gather', 'always')!r}); median "
        f"of {s['updates']} updates per learning rate after {s['warmup']} warm-up; load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after (a shared machine: compare ratios within "
        "the run)",
    ]
    for lr, r in result["per_lr"].items():
        secs = r["seconds"]
        delta_b = statistics.mean(r["bytes_per_engine_rank"]["delta"].values())
        full_b = statistics.mean(r["bytes_per_engine_rank"]["full"].values())
        lines += [
            f"  lr {lr}: {r['changed_fraction']:.3%} of elements changed per step; bytes per engine rank: delta "
            f"{delta_b / 1e6:.2f} MB, full {full_b / 1e6:.2f} MB ({r['full_over_delta_bytes']:.1f}x fewer)",
            f"    s/update: p2p-delta {secs['p2p-delta']:.3f}, p2p full {secs['p2p']:.3f}, broadcast "
            f"{secs['broadcast']:.3f}; full / delta {r['full_over_delta_seconds']:.2f}x, broadcast / delta "
            f"{r['broadcast_over_delta_seconds']:.2f}x",
            f"    proving the engines' baselines: p2p-delta {secs['p2p-delta']:.3f} s against "
            f"{secs['p2p-delta-unproven']:.3f} s unproven ({r['proof_fraction']:+.1%} of the update)",
            *(
                f"    {name} on trainer-0, s: " + ", ".join(f"{p} {t:.3f}" for p, t in phases.items() if t >= 0.0005)
                for name, phases in r["trainer0_phases"].items()
            ),
        ]
    for trainer, m in result["trainer_memory"].items():
        lines.append(
            f"  {trainer} holds {m['delta_bytes'] / 1e6:.1f} MB for delta mode (baselines "
            f"{m.get('baseline_bytes', 0) / 1e6:.1f} MB, patch buffers {m.get('patch_buffer_bytes', 0) / 1e6:.1f} MB; "
            f"it sends {m.get('gather_free_bytes', 0) / 1e6:.1f} MB of an update gather-free), beside "
            f"{m['buffer_bytes'] / 1e6:.1f} MB of transfer buffers"
        )
    verdict = "yes" if result["verified"] else f"NO: {result['mismatches']}"
    lines.append(f"  verified (a checked delta update, then every parameter equal to a full update's): {verdict}")
    return "\n".join(lines)
