"""Bench results: what the trainer and engine ranks measured, summarized per way (time and
where it went, bytes, verification, the way's lower bound on this machine), and the text
table of a whole run."""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.report import format_phases
from .options import TRAINERS

#: What an update's own Python objects (reports, lists, pymalloc's 1 MiB arenas) may add to RSS, beside its
#: buffers and tensors: measured 0.3-1 MB on the tiny model, where nothing else is large.
INTERPRETER_BYTES = 2 << 20
#: Phases of each way's update, in the order they happen (see `Session.phase_seconds`, `broadcast.Leader.send`,
#: `ways.BroadcastWay.update`).
PHASES = ("pause", "command", "gather", "produce", "buffer_wait", "drain", "engine_load", "verify", "finish")


def writing_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """How long at least one of `intervals` (writes of all senders, one clock) was running."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _median_phases(updates: Sequence[Mapping[str, float]]) -> dict[str, float]:
    names = [p for p in PHASES if any(p in u for u in updates)] + sorted({p for u in updates for p in u} - set(PHASES))
    return {p: statistics.median(u.get(p, 0.0) for u in updates) for p in names}


def _raw(limits: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of a raw rate measured before and after the syncs (GB/s), or None."""
    rates = [m[key]["gbps"] for m in limits if m.get(key)]
    return statistics.mean(rates) if rates else None


def _mismatches(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))


def summary(raw: Mapping[str, Any], limits: Mapping[str, Any], limits_after: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON result of a run from what trainer rank 0 collected (`raw`) and the machine's
    limits measured before and after. Per way: median seconds (and each update's), where
    rank 0's time went, bytes sent and received (measured or counted, said which), whether
    the engines held the reference's bytes, and its lower bound on this machine: the larger
    of its gathers alone and its bytes on the wire at the raw rate of its transport."""
    seconds, per_rank = raw["seconds"], raw["per_rank"]
    members = [f"{engine}/{rank}" for engine, rank in raw["members"]]
    reference = next((w["name"] for w in raw["ways"] if w["reference"]), None)
    held = raw["held"]
    ways: dict[str, Any] = {}
    for spec in raw["ways"]:
        name = spec["name"]
        times = seconds[name]
        gathers = raw["gathers_of"][name]
        way: dict[str, Any] = {
            "description": spec["description"], "seconds": statistics.median(times), "seconds_all": times,
            "phases": {f"trainer-{r}": _median_phases(rank["phases"][name]) for r, rank in enumerate(per_rank)},
            "gathers_alone_seconds": statistics.median(seconds[gathers]), "gathers_step": gathers,
        }
        if spec.get("p2psync"):
            way.update(_p2p_bytes(raw, name, per_rank))
            way.update(gather_free_bytes=spec["gather_free_bytes"], gathered_bytes=spec["gathered_bytes"])
            writing = [writing_seconds([i for rank in per_rank for i in rank["write_intervals"][name][k]])
                       for k in range(len(times))]
            way["writing_seconds"] = statistics.median(writing)
            way["writing_seconds_all"] = writing
            raw_key = "raw_transport"
        else:
            way.update(_broadcast_bytes(raw, name, members, per_rank))
            raw_key = "raw_gloo"
        rate = _raw([limits, limits_after], raw_key)
        way["received_total"] = sum(way["bytes_per_engine_rank"].values())
        way["gbps"] = way["received_total"] / way["seconds"] / 1e9
        way["wire_bytes"] = sum(way["bytes_per_sender"].values())
        way["wire_how"] = "every sender's bytes at the raw loopback rate (one memory bus carries them all)"
        if raw.get("nic_bytes", {}).get(name):
            way.update(_nic_figures(raw["nic_bytes"][name]))
            way["wire_bytes"] = way["nic_bytes"][way["busiest_nic"]]
            way["wire_how"] = f"the busiest NIC's bytes ({way['busiest_nic']}, its tc class) at the link's measured rate"
            rate = _raw([limits, limits_after], "raw_link")
        way["raw_gbps"] = rate
        way["wire_seconds_at_raw"] = way["wire_bytes"] / rate / 1e9 if rate else None
        way["bound_seconds"] = max(way["gathers_alone_seconds"], way["wire_seconds_at_raw"] or 0.0)
        way["over_bound"] = way["seconds"] / way["bound_seconds"]
        way.update(_cpu_figures(raw.get("cpu", {}), name, gathers))
        if reference is None or name not in held or reference not in held:
            way["verified_by"] = (
                "p2psync's digest check" if spec.get("p2psync") else "not compared (no reference way ran)"
            )
            way["mismatches"] = []
        elif name == reference:
            way["verified_by"] = "the reference: the engines' own loaders made these bytes"
            way["mismatches"] = []
        else:
            way["verified_by"] = f"every parameter of every engine rank equal to after {reference!r}"
            way["mismatches"] = _mismatches(held[reference], held[name])[:10]
        way["verified"] = not way["mismatches"]
        way["reference"] = name == reference
        ways[name] = way
    prediction = None
    if raw["setup"].get("cluster"):
        from .cluster_predict import predict_run

        prediction = predict_run(raw["setup"], ways, [limits, limits_after], os.cpu_count() or 1)
    return {
        "setup": raw["setup"],
        "ways": ways,
        "prediction": prediction,
        "gathers": {step: {"seconds": statistics.median(seconds[step]), "seconds_all": seconds[step]}
                    for step in sorted(set(raw["gathers_of"].values()))},
        "ratios": _ratios(ways),
        "best_broadcast": best_broadcast(ways),
        "trainer_memory": {f"trainer-{r}": trainer_memory(rank["memory"], raw["gathers_of"])
                           for r, rank in enumerate(per_rank)},
        "connect": {f"trainer-{r}": rank["connect"] for r, rank in enumerate(per_rank)},
        "limits": limits,
        "limits_after": limits_after,
    }


def _cpu_figures(cpu: Mapping[str, Sequence[Sequence[float]]], name: str, gathers: str) -> dict[str, Any]:
    """The machine's CPU-seconds in a way's timed updates and in its gathers alone (medians),
    and the share of the cores' time the way kept busy over the seconds they were counted
    over (1.0: every core busy throughout). Those seconds are the update's and the barrier
    before it: a way's own seconds start after the barrier, where the CPU-seconds cannot."""
    if not cpu.get(name):
        return {}
    spent = statistics.median(c for c, _ in cpu[name])
    window = statistics.median(w for _, w in cpu[name])
    alone = statistics.median(c for c, _ in cpu[gathers]) if cpu.get(gathers) else None
    return {"cpu_seconds": spent, "cpu_window_seconds": window, "gathers_alone_cpu_seconds": alone,
            "cores_busy": spent / (window * (os.cpu_count() or 1))}


def _nic_figures(updates: Sequence[Mapping[str, int]]) -> dict[str, Any]:
    """What each NIC of a cluster in a box sent in a way's timed updates (median), measured by
    its tc class, and the busiest of them."""
    per_nic = {nic: statistics.median(u[nic] for u in updates) for nic in updates[0]}
    return {"nic_bytes": per_nic, "busiest_nic": max(per_nic, key=lambda nic: per_nic[nic])}


def _p2p_bytes(raw: Mapping[str, Any], name: str, per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    sent = {f"trainer-{r}": statistics.median(rank["sent"][name]) for r, rank in enumerate(per_rank)}
    return {
        "bytes_per_sender": sent, "bytes_per_engine_rank": dict(raw["rank_bytes"][name]),
        "bytes_how": "counted by p2psync's writers: the bytes of every write that completed",
    }


def _broadcast_bytes(
    raw: Mapping[str, Any], name: str, members: Sequence[str], per_rank: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Sent: what each member's broadcast-group threads wrote to their sockets in this way's timed
    updates (median), relays included; received: the payload each engine rank received."""
    timed = [i for i, way in enumerate(raw["broadcast_log"]) if way == name]
    payload = raw["payload"]
    sent = {"trainer-0": statistics.median(per_rank[0]["sent"][name])}
    sent.update({f"trainer-{r}": 0 for r in range(1, len(per_rank))})
    for member, stats in zip(members, raw["engine_stats"]):
        relayed = statistics.median(stats["sent_bytes"][i] for i in timed)
        if relayed > payload // 100:  # not just the commands' bytes
            sent[f"{member} (relay)"] = relayed
    load = [max(stats["load_seconds"][i] for stats in raw["engine_stats"]) for i in timed]
    return {
        "bytes_per_sender": sent, "bytes_per_engine_rank": dict.fromkeys(members, payload),
        "bytes_how": "sent: measured, what each member's gloo threads wrote to sockets (/proc per-thread wchar); "
                     "received: the flat buffers each engine rank received",
        "engine_load_seconds": statistics.median(load),
    }


def best_broadcast(ways: Mapping[str, Any]) -> str | None:
    """The broadcast to beat: the fastest (median) of the broadcasts sending in the engines' dtype."""
    broadcasts = [name for name in ("broadcast", "broadcast-chain") if name in ways]
    return min(broadcasts, key=lambda name: ways[name]["seconds"]) if broadcasts else None


def _ratios(ways: Mapping[str, Any]) -> dict[str, Any]:
    """Each other way's seconds over p2psync's, and each broadcast's over gather-free p2psync's:
    of the medians, round by round, and the ratio of their bounds (the ideal)."""
    pairs = [(name, "p2p") for name in ways if name != "p2p" and "p2p" in ways]
    pairs += [(name, "gather-free") for name in ways if name.startswith("broadcast") and "gather-free" in ways]
    return {
        f"{name}/{base}": {
            "of_medians": ways[name]["seconds"] / ways[base]["seconds"],
            "per_round": [b / p for p, b in zip(ways[base]["seconds_all"], ways[name]["seconds_all"])],
            "of_bounds": ways[name]["bound_seconds"] / ways[base]["bound_seconds"],
        }
        for name, base in pairs
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


#: The prefix of each p2psync way's memory figures (transfer buffers, largest gathered group, gathers' peak).
MEMORY_KEYS = {"p2p": "", "gather-free": "gather-free_"}


def trainer_memory(memory: Mapping[str, int], gathers_of: Mapping[str, str]) -> dict[str, Any]:
    """One trainer rank's memory figures, with each p2psync way's bound: what an update may add
    to the rank's RSS, from the first update on, is its two transfer buffers (their pages are
    first touched then), its largest gathered parameter group, and two buckets' gathers (one
    bucket is produced while the next is gathered), each as the trainer does them
    (`gathers_of[way]`: that step, timed alone in the same run; FSDP2 over gloo holds the
    gathered bucket, gloo's flat copy of it and the padded shards at once),
    beside `INTERPRETER_BYTES` of the interpreter's own. Gather-free, only the groups that are
    not copies are gathered: with none, its bound is its transfer buffers alone."""
    out: dict[str, Any] = dict(memory)
    for way, prefix in MEMORY_KEYS.items():
        if f"{way}_first_added_bytes" not in memory or way not in gathers_of:
            continue
        gathers = gathers_of[way]
        peak = max(memory.get(f"{gathers}_first_added_bytes", 0), memory.get(f"{gathers}_later_added_bytes", 0))
        out[f"{prefix}gathers_peak_bytes"] = peak
        out["interpreter_bytes"] = INTERPRETER_BYTES
        bound = memory[f"{prefix}transfer_buffers_bytes"] + memory[f"{prefix}largest_group_bytes"] + 2 * peak
        out[f"{way}_bound_bytes"] = bound + INTERPRETER_BYTES
        added = max(memory[f"{way}_first_added_bytes"], memory.get(f"{way}_later_added_bytes", 0))
        out[f"{way}_within_bound"] = added <= out[f"{way}_bound_bytes"]
    return out


def _engine_dtype(engine: Mapping[str, Any]) -> str:
    """The engines' dtype, and for fp8 engines their quantizer and block (every way quantizes on the trainer)."""
    fp8 = engine.get("fp8")
    if not fp8:
        return str(engine["dtype"])
    block = f"block {fp8['block']}" if fp8["block"] else "per tensor"
    return f"fp8 {block} quantized by {fp8['quantizer']!r} on the trainer, {engine['dtype']} otherwise"


def format_report(result: Mapping[str, Any]) -> str:
    """The run as text: setup, one row per way, where each way's time went and its bound,
    ratios, trainer memory, the machine."""
    s = result["setup"]
    model, engine = s["model"], s["engine"]
    load = [m["load_average"][0] for m in (result["limits"], result["limits_after"])]
    lines = [
        f"model {model['size']}: {model['parameters']:,} parameters, {_mb(model['bytes'])} ({model['dtype']}); "
        f"{s['trainers']} {TRAINERS[s.get('trainer', 'fsdp2')]} trainer ranks -> {s['engines']} {engine['kind']} engines "
        f"({engine['tp']} rank{'s' if engine['tp'] > 1 else ''} each, {_engine_dtype(engine)}); transport "
        f"{s['transport']['transport']} ({s['transport'].get('protocol', '-')}); median of {s['updates']} updates "
        f"after "
        f"{s['warmup']} warm-up; load average {load[0]:.1f} before, {load[1]:.1f} after (a shared machine: "
        "compare ratios within the run)",
        *_cluster_lines(s.get("cluster")),
        "",
        f"  {'way':<15} {'s/update':>9} {'(min-max)':>13} {'GB/s':>6} {'bound s':>8} {'x bound':>8}  verified",
    ]
    for name, w in result["ways"].items():
        spread = f"({min(w['seconds_all']):.2f}-{max(w['seconds_all']):.2f})"
        check = "yes" if w["verified"] else f"NO: {w['mismatches'][:3]}"
        lines.append(
            f"  {name:<15} {w['seconds']:>9.3f} {spread:>13} {w['gbps']:>6.2f} {w['bound_seconds']:>8.3f} "
            f"{w['over_bound']:>7.2f}x  {check} ({w['verified_by']})"
        )
    for key, r in result["ratios"].items():
        per = r["per_round"]
        best = " (the best broadcast)" if key.split("/")[0] == result.get("best_broadcast") else ""
        lines.append(f"  {key}{best}: {r['of_medians']:.2f}x (round by round {min(per):.2f}-{max(per):.2f}x; "
                     f"ideal, of the bounds: {r.get('of_bounds', float('nan')):.2f}x)")
    lines += _prediction_lines(result.get("prediction"))
    lines.append("")
    for name, w in result["ways"].items():
        lines += _way_lines(name, w)
    for trainer, m in result["trainer_memory"].items():
        lines.append(_memory_line(trainer, m, list(result["ways"])))
    for trainer, sessions in result.get("connect", {}).items():  # runs kept from before have none
        for session, phases in sessions.items():
            lines.append(f"  {trainer} connect of the {session} session: {format_phases(phases)}")
    for when, machine in (("before", result["limits"]), ("after", result["limits_after"])):
        memcpy = machine["memcpy"]
        line = (f"  machine {when} (load average {', '.join(f'{x:.1f}' for x in machine['load_average'])}): memcpy "
                f"{memcpy['gbps']:.2f} GB/s ({memcpy['threads']} threads)")
        for key in ("raw_transport", "raw_gloo"):
            if machine.get(key):
                raw = machine[key]
                line += f"; raw {raw['transport']} ({raw['protocol']}) loopback {raw['gbps']:.2f} GB/s"
        if machine.get("raw_link"):
            link = machine["raw_link"]
            line += f"; the link, one TCP connection between nodes: {link['gbps']:.3f} GB/s " \
                    f"(shaped to {link['configured_gbps']:.3f})"
        lines.append(line)
    return "\n".join(lines)


def _cluster_lines(topology: Mapping[str, Any] | None) -> list[str]:
    if topology is None:
        return []
    trainers = " + ".join(str(n) for n in topology["trainer_nodes"])
    link = f"{topology['link_gbit']:g} Gbit/s"
    if topology["latency_ms"] or topology["loss_percent"]:
        link += f", {topology['latency_ms']:g} ms, {topology['loss_percent']:g}% lost"
    return [
        f"cluster in a box {topology['name']!r}: trainer ranks on nodes of {trainers}; {topology['engines']} engine "
        f"node{'s' if topology['engines'] > 1 else ''} of {topology['tp']} ranks; one NIC per {topology['nic']} "
        f"({len(topology['nics'])} NICs) on {link}; inside a node unshaped",
    ]


def _prediction_lines(prediction: Mapping[str, Any] | None) -> list[str]:
    if not prediction:
        return []
    if "skipped" in prediction:
        return [f"  planner: no prediction ({prediction['skipped']})"]
    lines = [f"  planner ({prediction['model']}):"]
    for name, w in prediction["ways"].items():
        parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in w.items() if k.endswith("_s") and k not in (
            "predicted_s", "measured_s"))
        lines.append(f"    {name:<15} predicted {w['predicted_s']:.3f} s, measured {w['measured_s']:.3f} s: "
                     f"{w['error']:+.0%}{'' if w['within_tolerance'] else ' (over 20%: the model misses something)'}"
                     f" [{parts}]")
    return lines


def _way_lines(name: str, w: Mapping[str, Any]) -> list[str]:
    phases = w["phases"]["trainer-0"]
    split = ", ".join(f"{p} {t:.3f}" for p, t in phases.items() if t >= 0.0005)
    lines = [f"  {name}: {w['description']}", f"    trainer-0's update, s: {split}"]
    extra = [f"gathers alone {w['gathers_alone_seconds']:.3f} s ({w['gathers_step']})"]
    if "writing_seconds" in w:
        extra.append(f"a write running {w['writing_seconds']:.3f} s (all senders)")
    if "engine_load_seconds" in w:
        extra.append(f"engine ranks' loaders {w['engine_load_seconds']:.3f} s (the slowest rank)")
    if w["wire_seconds_at_raw"] is not None:
        wire = f"its busiest NIC's {_mb(w['wire_bytes'])} ({w['busiest_nic']})" if "busiest_nic" in w else (
            f"its {_mb(w['wire_bytes'])} on the wire")
        extra.append(f"{wire} at raw {w['raw_gbps']:.2f} GB/s: {w['wire_seconds_at_raw']:.3f} s")
    lines.append("    " + "; ".join(extra) + f"; bound = the larger: {w['bound_seconds']:.3f} s")
    sent = ", ".join(f"{k} {_mb(v)}" for k, v in w["bytes_per_sender"].items())
    received = ", ".join(f"{k} {_mb(v)}" for k, v in w["bytes_per_engine_rank"].items())
    lines.append(f"    sent: {sent}; received: {received} ({w['bytes_how']})")
    if "nic_bytes" in w:
        lines.append("    NICs sent (tc class counters): " + ", ".join(f"{k} {_mb(v)}" for k, v in w["nic_bytes"].items()))
    return lines


def _memory_line(trainer: str, m: Mapping[str, Any], ways: Sequence[str]) -> str:
    parts = []
    for way in ways:
        line = f"{way} first {_mb(m[f'{way}_first_added_bytes'])}, later {_mb(m.get(f'{way}_later_added_bytes', 0))}"
        if f"{way}_bound_bytes" in m:
            prefix = MEMORY_KEYS[way]
            line += (
                f"; bound {_mb(m[f'{way}_bound_bytes'])} = 2 transfer buffers {_mb(m[f'{prefix}transfer_buffers_bytes'])}"
                f" + largest gathered group {_mb(m[f'{prefix}largest_group_bytes'])} + two buckets' gathers "
                f"(one produced, the next gathered) 2 x {_mb(m[f'{prefix}gathers_peak_bytes'])} (alone, at their "
                f"peak) + the interpreter's "
                f"{_mb(m['interpreter_bytes'])}: {'within' if m[f'{way}_within_bound'] else 'OVER'}"
            )
        parts.append(line)
    return f"  {trainer} peak RSS added: " + "; ".join(parts)
