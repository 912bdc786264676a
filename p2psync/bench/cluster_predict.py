"""The planner's prediction of a cluster bench run, beside what the run measured.

The planner (`p2psync.planner`) is given the run's topology as a `Cluster` (every rank its
own NIC), the engines' analytic per-rank shapes of the bench's model, and the rates the run
measured: the link (one TCP connection between nodes), each way's gathers alone, memcpy for
production, and each way's pause and finish calls. It predicts the wire of every way from
its real plan (`planner.predict`: p2psync's plan, the gather-free floor, the chain as NCCL's
ring, gloo's broadcast as its binomial tree), and the whole update as the bench runs it:

- p2psync, gathering: pause + max(gathers, production, wire) + finish (pipelined by bucket);
- gather-free: pause + max(production spread over every trainer rank, wire floor) + finish;
- the broadcasts: pause + max(gathers, wire) + production + finish (the next bucket's gathers
  run while this one is broadcast; trainer rank 0 packs every bucket).

Only `nic="rank"` topologies are modelled (the planner packs engines onto nodes of one size).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

#: The planner's broadcast model of each broadcast way.
BROADCAST_MODELS = {"broadcast": "tree", "broadcast-chain": "ring", "broadcast-fp32": "tree"}
#: Over this relative error the model, not the tolerance, is to be fixed.
TOLERANCE = 0.20
MODEL = (
    "p2p: pause + max(gathers alone, production at memcpy, wire of its plan) + finish; gather-free: pause + "
    "max(production over all trainer ranks, wire floor) + finish; broadcasts: pause + max(gathers alone, wire: "
    "chain = ring, gloo = binomial tree) + production + finish; link = one TCP connection's measured rate"
)


def predict_run(setup: Mapping[str, Any], ways: Mapping[str, Any], limits: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Each way's predicted seconds, its parts, and the error against its measured median."""
    from ..planner.cluster import Cluster
    from ..planner.predict import predict
    from ..planner.shapes import analytic_shapes
    from .model import hf_config

    topology = setup["cluster"]
    if topology["nic"] != "rank" or setup["engine"]["kind"] == "torch":
        return {"skipped": "the planner models sglang and vLLM engines with one NIC per rank"}
    link = statistics.mean(m["raw_link"]["gbps"] for m in limits)
    memcpy = statistics.mean(m["memcpy"]["gbps"] for m in limits) * 1e9
    node = max([*topology["trainer_nodes"], topology["tp"]])
    cluster = Cluster(
        train_ranks=setup["trainers"], engines=topology["engines"], engine_tp=topology["tp"], gpus_per_node=node,
        nics_per_node=node, nic_gbps=link * 8, latency_us=50.0,
    )
    shapes = analytic_shapes(hf_config(setup["model"]["size"]), topology["tp"], 1, "bf16", "the bench's model")
    p2p = predict(cluster, shapes, "ring")
    wires = {name: predict(cluster, shapes, model).broadcast_s for name, model in BROADCAST_MODELS.items()}
    out: dict[str, Any] = {
        "link_gbps": link, "produce_gbps": memcpy / 1e9, "latency_us": cluster.latency_us,
        "model": MODEL, "ways": {},
    }
    for name, way in ways.items():
        phases = way["phases"]["trainer-0"]
        control = phases.get("pause", 0.0) + phases.get("finish", 0.0)
        gathers = way["gathers_alone_seconds"]
        if name == "p2p":
            parts = {"gathers_s": gathers, "production_s": max(p2p.sender_bytes.values()) / memcpy, "wire_s": p2p.p2p_s}
            total = max(parts.values())
        elif name == "gather-free":
            parts = {"production_s": sum(p2p.sender_bytes.values()) / cluster.train_ranks / memcpy,
                     "wire_s": p2p.floor_s}
            total = max(parts.values())
        elif name in wires:
            parts = {"gathers_s": gathers, "wire_s": wires[name], "production_s": max(p2p.stage_full_bytes) / memcpy}
            total = max(parts["gathers_s"], parts["wire_s"]) + parts["production_s"]
        else:
            continue
        predicted = control + total
        error = predicted / way["seconds"] - 1
        out["ways"][name] = {**parts, "control_s": control, "predicted_s": predicted, "measured_s": way["seconds"],
                             "error": error, "within_tolerance": abs(error) <= TOLERANCE}
    return out
