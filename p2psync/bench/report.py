"""Bench results: one `Way` per sync path, and the text table of a whole run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Way:
    """One sync path, measured: seconds of each timed update, bytes per update sent by each
    trainer rank and received by each engine rank, and whether the engines held the
    trainer's bytes afterwards (`mismatches` names the parameters that differed)."""

    seconds_all: list[float]
    bytes_per_sender: dict[str, int]
    bytes_per_engine_rank: dict[str, int]
    mismatches: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(self.seconds_all)

    @property
    def gbps(self) -> float:
        """Bytes received by all engine ranks per second of update."""
        return sum(self.bytes_per_engine_rank.values()) / self.seconds / 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "seconds_all": self.seconds_all,
            "bytes_per_sender": self.bytes_per_sender,
            "bytes_per_engine_rank": self.bytes_per_engine_rank,
            "gbps": self.gbps,
            "verified": not self.mismatches,
            "mismatches": self.mismatches[:10],
        }


def writing_seconds(intervals: list[tuple[float, float]]) -> float:
    """How long at least one of `intervals` (writes of all senders, one clock) was running."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summary(
    setup: dict[str, Any], ways: dict[str, Way], limits: dict[str, Any], limits_after: dict[str, Any]
) -> dict[str, Any]:
    """The JSON result of a run. p2psync's transfer phase is the time any of its writes was
    running (they overlap the gathers), its throughput all bytes over that time; it is
    compared with the mean of the raw throughput measured before and after the syncs."""
    p2p, broadcast = ways["p2p"], ways["broadcast"]
    raws = [m["raw_transport"]["gbps"] for m in (limits, limits_after) if m["raw_transport"]]
    raw = statistics.mean(raws) if raws else None
    writing = statistics.median(setup["p2p_writing_seconds"])
    transfer = sum(p2p.bytes_per_engine_rank.values()) / writing / 1e9
    return {
        **setup,
        "ways": {name: way.to_json() for name, way in ways.items()},
        "ratio_broadcast_over_p2p": broadcast.seconds / p2p.seconds,
        # each round's broadcast over the same round's p2psync update: the spread of the ratio
        "ratio_per_round": [b / p for p, b in zip(p2p.seconds_all, broadcast.seconds_all)],
        "limits": limits,
        "limits_after": limits_after,
        "raw_transport_gbps": raw,
        "p2p_over_raw_transport": p2p.gbps / raw if raw else None,
        "p2p_transfer_gbps": transfer,
        "p2p_transfer_over_raw_transport": transfer / raw if raw else None,
    }


def _bytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_report(result: dict[str, Any]) -> str:
    """The run as a table, one row per way, then the machine's limits."""
    model, engine = result["model"], result["engine"]
    lines = [
        (
            f"model {model['size']}: {model['parameters']:,} parameters, {_bytes(model['bytes'])} ({model['dtype']}); "
            f"{result['trainers']} FSDP2 trainer ranks -> {result['engines']} {engine['kind']} engines "
            f"({engine['tp']} rank{'s' if engine['tp'] > 1 else ''} each, {engine['dtype']} dtype); "
            f"transport {result['transport']['name']} ({result['transport']['protocol']}); "
            f"median of {result['updates']} updates after {result['warmup']} warm-up"
        ),
        (
            f"  {'way':<10} {'s/update':>9} {'(min-max)':>13} {'GB/s':>6}  {'sent per sender':<36} "
            f"{'received per engine rank':<36} verified"
        ),
    ]
    for name, way in result["ways"].items():
        sent = ", ".join(f"{k} {_bytes(v)}" for k, v in way["bytes_per_sender"].items())
        received = ", ".join(f"{k} {_bytes(v)}" for k, v in way["bytes_per_engine_rank"].items())
        spread = f"({min(way['seconds_all']):.2f}-{max(way['seconds_all']):.2f})"
        lines.append(
            f"  {name:<10} {way['seconds']:>9.3f} {spread:>13} {way['gbps']:>6.2f}  {sent:<36} {received:<36} "
            + ("yes" if way["verified"] else f"NO: {way['mismatches'][:3]}")
        )
    lines.append(
        f"  broadcast / p2p: {result['ratio_broadcast_over_p2p']:.2f}x (round by round "
        f"{min(result['ratio_per_round']):.2f}-{max(result['ratio_per_round']):.2f}x, median "
        f"{statistics.median(result['ratio_per_round']):.2f}x); "
        f"the FSDP2 gathers alone as the broadcast path makes them (trainer dtype): {result['gather_seconds']:.3f} s"
    )
    for trainer, m in result.get("trainer_memory", {}).items():
        added = m["p2p_first_added_bytes"]
        bound = m["transfer_buffers_bytes"] + m["largest_group_bytes"] + m["bucket_bytes"]
        lines.append(
            f"  {trainer} peak RSS added by p2psync's first update: {_bytes(added)} (kept after it: "
            f"{_bytes(m.get('p2p_first_kept_bytes', 0))}; later ones: "
            f"{_bytes(m.get('p2p_later_added_bytes', 0))}); bound: 2 transfer buffers "
            f"{_bytes(m['transfer_buffers_bytes'])} + largest group {_bytes(m['largest_group_bytes'])} + one gathered "
            f"bucket {_bytes(m['bucket_bytes'])} = {_bytes(bound)} ({'within' if added <= bound else 'OVER'}); "
            f"the broadcast path's: {_bytes(m['broadcast_first_added_bytes'])} (later ones: "
            f"{_bytes(m.get('broadcast_later_added_bytes', 0))}); the gathers alone: "
            f"{_bytes(m['gathers_first_added_bytes'])}"
        )
    for when, machine in (("before", result["limits"]), ("after", result["limits_after"])):
        memcpy, raw = machine["memcpy"], machine["raw_transport"]
        limit = (
            f"  machine {when} the syncs (load average {machine['load_average']:.1f}): memcpy {memcpy['gbps']:.2f} "
            f"GB/s ({memcpy['threads']} threads, {_bytes(memcpy['bytes'])})"
        )
        if raw:
            limit += (
                f"; raw {raw['transport']} {raw['protocol']} loopback {raw['gbps']:.2f} GB/s "
                f"({_bytes(raw['bytes'])} in {_bytes(raw['chunk_bytes'])} writes)"
            )
        lines.append(limit)
    writing = result["p2p_writing_seconds"]
    transfer = (
        f"  p2p transfer phase (while any write ran: {min(writing):.2f}-{max(writing):.2f} s per update): "
        f"{result['p2p_transfer_gbps']:.2f} GB/s"
    )
    if raw:
        transfer += (
            f", {result['p2p_transfer_over_raw_transport']:.0%} of raw (mean of before and after); "
            f"whole update at {result['p2p_over_raw_transport']:.0%} of raw"
        )
    lines.append(transfer)
    return "\n".join(lines)
