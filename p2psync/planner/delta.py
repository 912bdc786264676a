"""Delta updates at cluster scale, predicted from a changed fraction.

The model, printed with every result:

- wire: each engine rank receives, per parameter region, the smallest of its dense bytes,
  a bitmap plus the changed elements, or int32 indices plus the changed elements (the
  encoding of `p2psync.core.delta`), with the changed elements spread evenly: a
  `wire_fraction` of its full bytes, at the engine's element size (bf16: 2 bytes; fp8:
  1 byte, its float32 scales counted as one-byte elements too, a slight overestimate
  of their savings that their small size makes negligible).
- sender: besides producing the bytes as in a full update, each sender compares them
  with its baseline and re-seeds it, once per unit (layout key and engine rank) it serves,
  however many engines share the unit (reads both, writes one: three times the unit's
  bytes) at `compare_gbytes`; the device path compares in GPU memory, while host buffers
  compare on the CPU, much slower.
- engine: applies its patch (reads the received bytes, scatters the changed elements)
  at `produce_gbytes`, before its post-load step.
- the gathers do not change: every sender still gathers every bucket.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..core.delta import cheapest, record_bytes
from .pipeline import chunks_of, pipeline_seconds
from .predict import Prediction

#: Element sizes of the engines' parameters, by the planner's engine dtype.
ELEMENT_BYTES = {"bf16": 2, "fp8": 1}
#: Elements per modelled region (a large parameter chunk; small ones barely change the ratio).
REGION_ELEMENTS = 1 << 20



@dataclass(frozen=True)
class DeltaCosts:
    """`changed_fraction` of the engines' elements change per update; senders compare at
    `compare_gbytes` per GPU (default: an assumption for the device path, memory-bound
    on an H100's HBM; host buffers compare at a few GB/s per core)."""

    changed_fraction: float
    compare_gbytes: float = 300.0


MODEL = (
    "delta: each engine rank receives {wire:.2%} of its full bytes ({kind}, {fraction:.2%} of elements changed, "
    "{elem}-byte elements); senders compare and re-seed baselines (3x each unit's bytes) at {compare:g} GB/s; "
    "engines apply at {produce:g} GB/s; gathers unchanged"
)


def wire_fraction(changed_fraction: float, elem_bytes: int) -> tuple[float, str]:
    """The fraction of its full bytes an engine rank receives, and the form chosen."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise ValueError(f"the changed fraction must lie in [0, 1], got {changed_fraction}")
    changed = round(changed_fraction * REGION_ELEMENTS)
    if changed == 0:
        return 0.0, "nothing"
    kind = cheapest(REGION_ELEMENTS, changed, elem_bytes)
    dense = REGION_ELEMENTS * elem_bytes
    sent = dense if kind == "dense" else record_bytes(kind, REGION_ELEMENTS, changed, elem_bytes)
    return sent / dense, kind


def compared_bytes(p: Prediction) -> int:
    """The most bytes one sender compares per update: each unit (pipeline stage, engine rank)
    it serves, once."""
    c = p.cluster
    per_sender: dict[int, int] = defaultdict(int)
    for stage, plan in enumerate(p.plans):
        layers = c.stage_layers(stage, len(p.shapes.layer_kinds))
        first, last = stage == 0, stage == c.train_pp - 1
        for sender, rank in {(sender, t.rank) for t, sender in plan.assignment.items()}:
            per_sender[sender] += p.shapes.rank_bytes(rank, layers, first, last)[0]
    return max(per_sender.values(), default=0)


def delta_way(
    p: Prediction, p2p: dict[str, float], costs: DeltaCosts, produce_gbytes: float, bucket_bytes: int
) -> dict[str, Any]:
    """The p2psync way of `whole_update` (`p2p`: its parts, in seconds) in delta mode, pipelined
    over buckets of `bucket_bytes` as the full update is."""
    elem = ELEMENT_BYTES[p.cluster.engine_dtype]
    fraction, kind = wire_fraction(costs.changed_fraction, elem)
    way: dict[str, Any] = dict(p2p)
    way["wire_s"] = p2p["wire_s"] * fraction
    way["compare_s"] = 3 * compared_bytes(p) / (costs.compare_gbytes * 1e9)
    way["apply_s"] = max(p.receiver_bytes.values()) * fraction / (produce_gbytes * 1e9)
    fixed = way["pause_s"] + way["finish_s"] + way["post_load_s"] + way["apply_s"]
    stages = [way["gathers_s"], way["production_s"] + way["compare_s"], way["wire_s"]]
    way["total_s"] = fixed + pipeline_seconds(stages, chunks_of(max(p.stage_full_bytes), bucket_bytes))
    way["wire_fraction"] = fraction
    way["model"] = MODEL.format(
        wire=fraction, kind=kind, fraction=costs.changed_fraction, elem=elem, compare=costs.compare_gbytes,
        produce=produce_gbytes,
    )
    return way
