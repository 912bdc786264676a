"""The planner's prediction of a cluster bench run, beside what the run measured.

The planner (`p2psync.planner`) is given the run's topology as a `Cluster` (every rank its
own NIC), the engines' analytic per-rank shapes of the bench's model, and the rates the run
measured: the link (one TCP connection between nodes), each way's gathers alone, memcpy,
each way's production (its produce phase: casts and strided copies, not a memcpy), the
loopback socket rates of Mooncake and gloo, and each way's pause and finish calls. It
predicts the wire of every way from its real plan (`planner.predict`: p2psync's plan, the
gather-free floor, the chain as NCCL's ring, gloo's broadcast as its binomial tree), and the
whole update as the bench runs it, the larger of two accounts:

- the pipeline: each way's stages (p2p, gathering, and the broadcasts: gathers, production,
  wire; gather-free: production, wire) over its chunks (buckets of `bucket_bytes`; a
  gather-free rank's bytes in transfer buffers of that size), a chunk entering a stage once
  it left the one before and the stage is free: the largest stage plus the others' first
  and last chunks;
- the box's cores: every emulated node shares this machine's cores, so the CPU-seconds of a
  way (gathers alone on min(trainer ranks, cores) cores, every socket byte at the loopback
  rate of its transport on both of its ends, production, and for Mooncake the write threads'
  spinning wait: one per trainer rank and engine, for the share of its wire time that
  `transports.mooncake.pacing` does not sleep through) over the cores bound it too. On a
  cluster each rank has cores of its own and this term vanishes;

plus pause and finish. Only `nic="rank"` topologies are modelled (the planner packs
engines onto nodes of one size).

fp8 engines (`--fp8`): the shapes are the engines' fp8 weights plus their float32 scales at
the run's block (per tensor: one scale per matrix), so every wire carries the fp8 bytes; each
way's production is its measured produce phase, which holds its quantizing. The gather-free way
gathers the quantized groups (a block's scale needs the whole block): its gathers are a stage,
and its wire is its gathered share of the bytes at p2p's plan, the rest at the gather-free
floor (an interpolation of the two plans, not a plan of its own).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..planner.pipeline import chunks_of, pipeline_seconds
from ..transports.mooncake.pacing import SLEEP_SHARE
from ..worlds.netbox import Link
from .cluster import Topology

if TYPE_CHECKING:
    from ..planner.shapes import ShapeModel

#: The planner's broadcast model of each broadcast way.
BROADCAST_MODELS = {"broadcast": "tree", "broadcast-chain": "ring", "broadcast-fp32": "tree"}
#: A block larger than any matrix: one scale per matrix, as per-tensor fp8 holds (sglang keeps one per
#: shard of a fused matrix: a few bytes more than this).
PER_MATRIX = 1 << 30
#: Over this relative error the model, not the tolerance, is to be fixed.
TOLERANCE = 0.20
MODEL = (
    "pause + max(pipeline, box cores) + finish; pipeline: stages over chunks of bucket_bytes (p2p and broadcasts: "
    "gathers alone + what they wait behind the way's sends on a NIC both use, production, wire; gather-free: "
    "production, wire floor, and where it gathers (fp8) those gathers and its gathered share of the bytes at p2p's "
    "wire; wire of the way's plan: p2p's, chain = ring, gloo = binomial tree); box cores = CPU-seconds (gathers on "
    "min(ranks, cores) cores, socket bytes at "
    "loopback rate on both ends, production, Mooncake's write threads spinning the unslept share of their wire "
    "time) / cores; link = one TCP connection's measured rate"
)


def shared_nic_seconds(topology: Mapping[str, Any], way: Mapping[str, Any], link_bytes_per_s: float) -> float:
    """Seconds a way's gathers wait behind its own sends on the trainer NIC where that costs
    most: the gathers' seconds on that NIC, times the share of the gathers' time alone that
    the sends are on it."""
    gathers = way["gathers_alone_seconds"]
    if gathers <= 0:
        return 0.0
    described = Topology(topology["name"], tuple(topology["trainer_nodes"]), topology["engines"], topology["tp"],
                         Link(gbit=topology["link_gbit"]))
    box, waited = described.box(), 0.0
    for rank in range(described.trainers):
        sent = way["bytes_per_sender"].get(f"trainer-{rank}", 0)
        gathered = max(0, way["nic_bytes"][box.nic_of(*described.trainer_place(rank)).name] - sent)
        waited = max(waited, gathered / link_bytes_per_s * min(1.0, sent / link_bytes_per_s / gathers))
    return waited


def _shapes(setup: Mapping[str, Any]) -> ShapeModel:
    """The engines' analytic per-rank shapes of the bench's model: bf16, or fp8 with the run's scales."""
    from ..planner.shapes import analytic_shapes
    from .model import hf_config

    config, tp = hf_config(setup["model"]["size"]), setup["cluster"]["tp"]
    fp8 = setup["engine"].get("fp8")  # results before --fp8 ran bf16 engines
    if not fp8:
        return analytic_shapes(config, tp, 1, "bf16", "the bench's model")
    block = fp8["block"][0] if fp8["block"] else PER_MATRIX
    return analytic_shapes(config, tp, 1, "fp8", "the bench's model, fp8", fp8_block=block)


def predict_run(
    setup: Mapping[str, Any], ways: Mapping[str, Any], limits: list[Mapping[str, Any]], cores: int
) -> dict[str, Any]:
    """Each way's predicted seconds, its parts, and the error against its measured median."""
    from ..planner.cluster import Cluster
    from ..planner.predict import predict

    topology = setup["cluster"]
    if topology["nic"] != "rank" or setup["engine"]["kind"] == "torch":
        return {"skipped": "the planner models sglang and vLLM engines with one NIC per rank"}

    def rate(key: str) -> float:
        return statistics.mean(m[key]["gbps"] for m in limits) * 1e9

    link = rate("raw_link") / 1e9
    node = max([*topology["trainer_nodes"], topology["tp"]])
    cluster = Cluster(
        train_ranks=setup["trainers"], engines=topology["engines"], engine_tp=topology["tp"], gpus_per_node=node,
        nics_per_node=node, nic_gbps=link * 8, latency_us=50.0,
    )
    shapes = _shapes(setup)
    p2p = predict(cluster, shapes, "ring")
    wires = {name: predict(cluster, shapes, model).broadcast_s for name, model in BROADCAST_MODELS.items()}
    engine_ranks = topology["engines"] * topology["tp"]
    model_bytes = max(p2p.stage_full_bytes)
    buckets = chunks_of(model_bytes, setup["bucket_bytes"])
    buffers = chunks_of(max(p2p.sender_bytes.values()), setup["bucket_bytes"])
    # CPU-seconds of one socket byte, both ends: the loopback rates were measured with one
    # sending and one receiving thread, on min(2, cores) cores
    socket_cost = {"mooncake": min(2, cores) / rate("raw_transport"), "gloo": min(2, cores) / rate("raw_gloo")}
    gather_cores = min(setup["trainers"], cores)
    # CPU-seconds of Mooncake's write threads spinning: one thread per trainer rank and engine it
    # writes to, whose batches are on the wire for as long as its rank's NIC takes for its bytes
    nic_seconds = {sender: nbytes / (link * 1e9) for sender, nbytes in p2p.sender_bytes.items()}
    spin = {
        "p2p": sum(nic_seconds[s] for s, _ in {(s, t.engine_id) for plan in p2p.plans for t, s in plan.assignment.items()}),
        "gather-free": topology["engines"] * sum(nic_seconds.values()),  # every rank feeds every engine
    }
    out: dict[str, Any] = {
        "link_gbps": link, "latency_us": cluster.latency_us, "cores": cores, "model": MODEL, "ways": {},
    }
    for name, way in ways.items():
        phases = way["phases"]["trainer-0"]
        control = phases.get("pause", 0.0) + phases.get("finish", 0.0)
        gathers, production = way["gathers_alone_seconds"], phases.get("produce", 0.0)
        waited = shared_nic_seconds(topology, way, link * 1e9)
        if name == "p2p":
            parts = {"gathers_s": gathers + waited, "production_s": production, "wire_s": p2p.p2p_s}
            pipeline = pipeline_seconds(list(parts.values()), buckets)
            cpu = sum(p2p.sender_bytes.values()) * socket_cost["mooncake"] + (1 - SLEEP_SHARE) * spin[name]
        elif name == "gather-free":
            free, gathered = way["gather_free_bytes"], way["gathered_bytes"]
            share = gathered / (free + gathered) if gathered else 0.0
            parts = {"gathers_s": gathers} if gathered else {}
            parts |= {"production_s": production, "wire_s": share * p2p.p2p_s + (1 - share) * p2p.floor_s}
            pipeline = pipeline_seconds(list(parts.values()), buffers)
            cpu = sum(p2p.sender_bytes.values()) * socket_cost["mooncake"] + (1 - SLEEP_SHARE) * spin[name]
        elif name in wires:
            parts = {"gathers_s": gathers + waited, "production_s": production, "wire_s": wires[name]}
            pipeline = pipeline_seconds(list(parts.values()), buckets)
            cpu = model_bytes * engine_ranks * socket_cost["gloo"]  # every engine rank receives it once
        else:
            continue
        parts["pipeline_s"] = pipeline
        parts["cores_s"] = (gathers * gather_cores + cpu + production) / cores
        predicted = control + max(pipeline, parts["cores_s"])
        error = predicted / way["seconds"] - 1
        out["ways"][name] = {**parts, "control_s": control, "predicted_s": predicted, "measured_s": way["seconds"],
                             "error": error, "within_tolerance": abs(error) <= TOLERANCE}
    return out
