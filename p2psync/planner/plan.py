"""A model on a cluster, planned: shapes, the real plan per pipeline stage, the wire, and the
whole update predicted, as one JSON-ready dict (what `p2psync plan` prints)."""

from __future__ import annotations

import time
from typing import Any

from .cluster import Cluster
from .delta import DeltaCosts, delta_way
from .update import Costs, whole_update


def plan_dict(
    cfg: dict[str, Any], model: str, cluster: Cluster, shapes: str = "auto", broadcast: str = "ring",
    costs: Costs | None = None, delta: DeltaCosts | None = None,
) -> dict[str, Any]:
    """Plan `cfg` (an HF config) named `model` on `cluster`; `shapes` picks the engine shapes'
    source (see `engine.shapes_for`), `broadcast` the broadcast path's wire model; `delta` adds
    p2psync's delta mode as a way (see `delta.delta_way`)."""
    from .engine import shapes_for
    from .predict import predict
    from .report import to_dict
    from .shapes import analytic_shapes

    t0 = time.perf_counter()
    sm = shapes_for(cfg, cluster.engine_tp, cluster.engine_ep, cluster.engine_dtype, shapes,
                    cluster.engine_dp_attention)
    t1 = time.perf_counter()
    prediction = predict(cluster, sm, broadcast)
    d = to_dict(prediction, model)
    d["shapes_s"], d["plans_s"] = t1 - t0, d["plan_build_s"]
    # what each pipeline stage holds gathered, as HF tensors in the trainer's dtype (analytic, unsharded)
    trainer = analytic_shapes(cfg, 1, 1, cluster.trainer_dtype)
    costs = costs or Costs()
    d["update"] = whole_update(prediction, trainer, costs)
    if delta is not None:
        d["update"]["ways"]["p2psync-delta"] = delta_way(
            prediction, d["update"]["ways"]["p2psync"], delta, costs.produce_gbytes, costs.bucket_bytes
        )
    for s, gathered in zip(d["stages"], d["update"]["stage_gathers"]):
        s["held_bytes_trainer_dtype"] = gathered["held_bytes"]
    d["plan_build_s"] = time.perf_counter() - t0
    return d
