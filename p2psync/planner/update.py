"""The whole update, predicted: the trainer's gathers, the production of the bytes, the wire
and the engines' control calls, for p2psync, for a gather-free P2P and for the broadcast path.

Every figure here is a prediction from stated rates (`Costs`, and the `Cluster`'s links),
not a measurement. The model, printed with every result:

- gathers: in each pipeline stage, every rank all-gathers the stage's HF tensors (trainer
  dtype), as p2psync's senders and the broadcast path's collectives do: the non-expert
  tensors over tensor parallel ((tp - 1) / tp of them cross each rank's link), the routed
  experts over expert parallel x expert TP ((E - 1) / E). A group of consecutive ranks that
  fits in a node all-gathers over NVLink, a wider one at the GPU's share of the NICs
  (ring all-gather); the stages gather at once.
- production: p2psync's senders fill their transfer buffers (copy map; quantization for an
  fp8 engine) at `produce_gbytes` per GPU; the broadcast path's stage heads cast or quantize
  the stage's full tensors at that rate, and every engine rank's loader copies its shard
  out of the received full tensors at that rate.
- wire: the link model of `predict`.
- control: `pause_s` and `finish_s` (resume, cache flush), and the engines' post-load
  step (fp8: `post_load_gbytes` per engine rank over its bytes).
- p2psync pipelines gathers, production and the wire bucket by bucket (`pipeline`: the
  slowest of the three plus the others' first and last buckets, as measured in the cluster
  in a box). The gather-free way (every trainer rank writes its own shard's contribution)
  has no gathers, production spread over every trainer rank, and the wire at the
  plan-independent floor, pipelined over transfer buffers of the bucket size. The broadcast
  path of miles/slime gathers a bucket, then broadcasts it: gathers, production and wire
  add up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..trainer.options import DEFAULT_BUCKET_BYTES
from .pipeline import chunks_of, pipeline_seconds
from .predict import Prediction
from .shapes import ShapeModel

#: Kimi-K2's fp8 engine post-load (requantizing block scales for DeepGEMM) costs ~884 ms per
#: rank at TP 32 (published); a TP-32 EP-32 fp8 rank holds 33.4 GB (this planner's analytic
#: shapes): about 37.8 GB/s of post-load per engine rank.
FP8_POST_LOAD_GBYTES = 33.4 / 0.884

MODEL = (
    "gathers: per stage, non-expert tensors all-gathered over TP, routed experts over EP x ETP, NVLink "
    "({nvlink:g} GB/s) inside a node, the GPU's NIC share ({nic:.0f} GB/s) across nodes, stages at once; "
    "production {produce:g} GB/s per GPU; pause {pause:g} s, finish {finish:g} s, post-load {post_load}; "
    "p2psync: gathers, production and wire pipelined over {bucket_mb:g} MiB buckets; gather-free: production over all "
    "trainer ranks and wire floor pipelined over transfer buffers of that size; "
    "broadcast: gathers + production + wire + engine load, in series"
)


@dataclass(frozen=True)
class Costs:
    """Rates and fixed costs outside the wire. Defaults: `produce_gbytes` an assumption (copies
    and quantization on an H100, well under its 3.35 TB/s HBM); `pause_s` and `finish_s` what
    `p2psync bench` measures for its control calls on CPU, rounded up (an engine with requests
    in flight pauses longer: prime-rl reports a 5.2 s pause around a 2.84 s update);
    `post_load_gbytes` None: Kimi-K2's published fp8 post-load rate for fp8 engines, none
    for bf16 engines (their post-load step only derives small tensors); `bucket_bytes` the
    session's default bucket (and transfer buffer) size."""

    produce_gbytes: float = 1000.0
    pause_s: float = 0.05
    finish_s: float = 0.05
    post_load_gbytes: float | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def post_load_rate(self, engine_dtype: str) -> float | None:
        """Bytes per second of the engines' post-load step, or None where there is none."""
        if self.post_load_gbytes is not None:
            return self.post_load_gbytes * 1e9
        return FP8_POST_LOAD_GBYTES * 1e9 if engine_dtype == "fp8" else None


def stage_gathers(p: Prediction, trainer: ShapeModel) -> list[dict[str, float]]:
    """Per pipeline stage: bytes held gathered (trainer dtype), of them the routed experts, and
    the seconds of the all-gathers that make every rank hold them."""
    c = p.cluster
    out = []
    for stage in range(c.train_pp):
        layers = c.stage_layers(stage, len(trainer.layer_kinds))
        first, last = stage == 0, stage == c.train_pp - 1
        held = trainer.full_bytes(layers, first, last)[0]
        experts = trainer.full_expert_bytes(layers, first, last)
        spread = c.train_ep * c.train_etp
        dense_s = (c.train_tp - 1) / c.train_tp * (held - experts) / c.group_bytes_per_s(c.train_tp)
        expert_s = (spread - 1) / spread * experts / c.group_bytes_per_s(spread)
        out.append({"held_bytes": held, "expert_bytes": experts, "dense_s": dense_s, "expert_s": expert_s,
                    "seconds": dense_s + expert_s})
    return out


def whole_update(p: Prediction, trainer: ShapeModel, costs: Costs) -> dict[str, Any]:
    """Each way's predicted update, part by part (see the module's docstring)."""
    c = p.cluster
    rate = costs.produce_gbytes * 1e9
    gathers = stage_gathers(p, trainer)
    gather_s = max(g["seconds"] for g in gathers)
    most_received = max(p.receiver_bytes.values())
    post_rate = costs.post_load_rate(c.engine_dtype)
    post_load_s = most_received / post_rate if post_rate else 0.0
    control = {"pause_s": costs.pause_s, "finish_s": costs.finish_s, "post_load_s": post_load_s}
    fixed = sum(control.values())
    p2p = {"gathers_s": gather_s, "production_s": max(p.sender_bytes.values()) / rate, "wire_s": p.p2p_s, **control}
    buckets = chunks_of(max(p.stage_full_bytes), costs.bucket_bytes)
    p2p["total_s"] = fixed + pipeline_seconds([p2p["gathers_s"], p2p["production_s"], p2p["wire_s"]], buckets)
    gather_free = {
        "gathers_s": 0.0, "production_s": sum(p.sender_bytes.values()) / c.train_ranks / rate, "wire_s": p.floor_s,
        **control,
    }
    buffers = chunks_of(max(p.sender_bytes.values()), costs.bucket_bytes)
    gather_free["total_s"] = fixed + pipeline_seconds([gather_free["production_s"], gather_free["wire_s"]], buffers)
    broadcast = {
        "gathers_s": gather_s, "production_s": max(p.stage_full_bytes) / rate + most_received / rate,
        "wire_s": p.broadcast_s, **control,
    }
    broadcast["total_s"] = fixed + broadcast["gathers_s"] + broadcast["production_s"] + broadcast["wire_s"]
    if costs.post_load_gbytes is not None:
        post_load = f"{costs.post_load_gbytes:g} GB/s per engine rank"
    else:
        post_load = f"fp8 engines {FP8_POST_LOAD_GBYTES:.1f} GB/s per engine rank (Kimi-K2's published 884 ms), bf16 none"
    return {
        "model": MODEL.format(nvlink=c.nvlink_gbytes, nic=c.nic_share_bytes_per_s / 1e9, produce=costs.produce_gbytes,
                              pause=costs.pause_s, finish=costs.finish_s, post_load=post_load,
                              bucket_mb=costs.bucket_bytes / (1 << 20)),
        "costs": asdict(costs),
        "stage_gathers": gathers,
        "ways": {"p2psync": p2p, "gather-free": gather_free, "broadcast": broadcast},
    }
