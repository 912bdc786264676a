"""Delta updates at cluster scale, predicted from a changed fraction.

The model, printed with every result:

- wire: each engine rank receives, per parameter region, the smallest of its dense bytes,
  a bitmap plus the changed elements, or int32 indices plus the changed elements (the
  encoding of `p2psync.core.delta`), with the changed elements spread evenly: a
  `wire_fraction` of its full bytes, at the engine's element size (bf16: 2 bytes; fp8:
  1 byte, its float32 scales counted as one-byte elements too, a slight overestimate
  of their savings that their small size makes negligible).
- sender: besides producing the bytes as in a full update, each sender compares them
  with its baseline and re-seeds it (reads both, writes one: three times the bytes it
  produces) at `compare_gbytes`; the device path compares in GPU memory, while host
  buffers compare on the CPU, much slower.
- engine: applies its patch (reads the received bytes, scatters the changed elements)
  at `produce_gbytes`, before its post-load step.
- the gathers do not change: every sender still gathers every bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.delta import cheapest, record_bytes

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
    "{elem}-byte elements); senders compare and re-seed baselines (3x the bytes they produce) at {compare:g} GB/s; "
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


def delta_way(
    p2p: dict[str, float], received_bytes: int, sent_bytes: int, engine_dtype: str, changed_fraction: float,
    produce_gbytes: float, compare_gbytes: float,
) -> dict[str, Any]:
    """The p2psync way of `whole_update` (`p2p`: its parts, in seconds) in delta mode: the most
    a sender produces is `sent_bytes`, the most an engine rank receives `received_bytes`."""
    elem = ELEMENT_BYTES[engine_dtype]
    fraction, kind = wire_fraction(changed_fraction, elem)
    way = dict(p2p)
    way["wire_s"] = p2p["wire_s"] * fraction
    way["compare_s"] = 3 * sent_bytes / (compare_gbytes * 1e9)
    way["apply_s"] = received_bytes * fraction / (produce_gbytes * 1e9)
    fixed = way["pause_s"] + way["finish_s"] + way["post_load_s"] + way["apply_s"]
    way["total_s"] = fixed + max(way["gathers_s"], way["production_s"] + way["compare_s"], way["wire_s"])
    way["wire_fraction"] = fraction
    way["model"] = MODEL.format(
        wire=fraction, kind=kind, fraction=changed_fraction, elem=elem, compare=compare_gbytes, produce=produce_gbytes
    )
    return way
