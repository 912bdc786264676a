"""The planner's prediction of a cluster bench run, beside what the run measured.

The planner (`p2psync.planner`) is given the run's topology as a `Cluster` (every rank its
own NIC), the engines' analytic per-rank shapes of the bench's model, and the rates the run
measured: the link (one TCP connection between nodes), each way's gathers alone, memcpy,
each way's production (its produce phase: casts and strided copies, not a memcpy), the
loopback socket rates of Mooncake and gloo, and each way's pause and finish calls. It
predicts the wire of every way from its real plan (`planner.predict`: p2psync's plan, the
gather-free floor, the chain as NCCL's ring, gloo's broadcast as its binomial tree), and the
whole update as the bench runs it: its steps over its chunks as a flow shop whose steps share
the box's cores (`planner.pipeline.shared_seconds`), plus pause and finish.

- The steps: the p2p way's gathers (on the thread that gathers ahead), production (the
  update's main thread) and wire, over buckets of `bucket_bytes`; the broadcasts' gathers and
  production both on their one thread, then the wire; the gather-free way's production and
  wire over the transfer buffers it fills for each engine shard, then, where it gathers some
  groups (fp8), those as the p2p way sends them. A chunk enters the pipeline once the one
  before it left its first step, and each resource serves one chunk at a time.
- The cores: every emulated node shares this machine's cores, so each step also spends
  CPU-seconds (the gathers' as measured alone; every socket byte at the loopback rate of its
  transport on both of its ends; production; for Mooncake the write threads' spinning wait:
  one per trainer rank and engine, for the share of its wire time that
  `transports.mooncake.pacing` does not sleep through), and steps running at once that want
  more cores than there are share them and slow down. On a cluster each rank has cores of its
  own and the steps run as the plain pipeline does.

A byte across the shaped link costs no more CPU than one inside a node: measured with one TCP
connection and a socket loop on both, 0.3-0.6 CPU-s/GB across at 0.5 and 2 Gbit/s against
0.6-0.67 inside (2026-12-06).

Only `nic="rank"` topologies are modelled (the planner packs engines onto nodes of one size).

fp8 engines (`--fp8`): the shapes are the engines' fp8 weights plus their float32 scales at
the run's block (per tensor: one scale per matrix), so every wire carries the fp8 bytes; each
way's production is its measured produce phase, which holds its quantizing. The gather-free way
gathers the quantized groups (a block's scale needs the whole block), after its own shards:
those go at the gather-free floor, the gathered share of the bytes at p2p's plan.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..planner.pipeline import Step, chunks_of, shared_seconds
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
#: The resources a way's steps occupy: the update's main thread (production, and the broadcasts'
#: gathers), the p2p gathers' thread ahead of it, and the wire.
MAIN, GATHERS, WIRE = "main thread", "gathers", "wire"
#: Over this relative error the model, not the tolerance, is to be fixed.
TOLERANCE = 0.20
MODEL = (
    "pause + steps over chunks as a flow shop sharing the box's cores + finish; steps: p2p = gathers (thread ahead), "
    "production, wire over buckets; broadcasts = gathers and production on one thread, then wire; gather-free = "
    "production, wire over each engine shard's transfer buffers, then (fp8) its gathered groups as p2p sends them; "
    "gathers also wait behind the way's sends on a NIC both use; wire of the way's plan: p2p's, gather-free floor, "
    "chain = ring, gloo = binomial tree; CPU-seconds: gathers as measured alone, socket bytes at loopback rate on "
    "both ends, production, Mooncake's write threads spinning the unslept share of their wire time; link = one "
    "TCP connection's measured rate"
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
    max_sent, bucket = max(p2p.sender_bytes.values()), setup["bucket_bytes"]
    buckets = chunks_of(model_bytes, bucket)

    def units(nbytes: float) -> list[float]:
        """A gather-free rank's `nbytes` as it sends them: transfer buffers per shard of the
        engines' (it writes every one), each written to that shard's rank of every engine."""
        shards = topology["tp"]
        return [c / shards for c in chunks_of(round(nbytes / shards), bucket)] * shards

    # CPU-seconds of one socket byte, both ends: the loopback rates were measured with one
    # sending and one receiving thread, on min(2, cores) cores
    socket_cost = {"mooncake": min(2, cores) / rate("raw_transport"), "gloo": min(2, cores) / rate("raw_gloo")}
    # CPU-seconds of Mooncake's write threads spinning: one thread per trainer rank and engine it
    # writes to, whose batches are on the wire for as long as its rank's NIC takes for its bytes
    nic_seconds = {sender: nbytes / (link * 1e9) for sender, nbytes in p2p.sender_bytes.items()}
    spin = {
        "p2p": sum(nic_seconds[s] for s, _ in {(s, t.engine_id) for plan in p2p.plans for t, s in plan.assignment.items()}),
        "gather-free": topology["engines"] * sum(nic_seconds.values()),  # every rank feeds every engine
    }
    # CPU-seconds of the Mooncake wire as each way writes (p2p's plan; gather-free, every rank to
    # every engine): every socket byte on both ends, and the write threads' unslept wait
    mooncake_cpu = {
        plan: sum(p2p.sender_bytes.values()) * socket_cost["mooncake"] + (1 - SLEEP_SHARE) * spun
        for plan, spun in spin.items()
    }
    out: dict[str, Any] = {
        "link_gbps": link, "latency_us": cluster.latency_us, "cores": cores, "model": MODEL, "ways": {},
    }
    for name, way in ways.items():
        phases = way["phases"]["trainer-0"]
        control = phases.get("pause", 0.0) + phases.get("finish", 0.0)
        gathers, production = way["gathers_alone_seconds"], phases.get("produce", 0.0)
        waited = shared_nic_seconds(topology, way, link * 1e9)
        gather = Step(GATHERS, gathers + waited, way["gathers_alone_cpu_seconds"])  # CPU-s as measured alone
        produce = Step(MAIN, production, production)
        gathers_s = gather.seconds
        if name == "p2p":  # gathers run ahead of production on a thread of their own
            wire = Step(WIRE, p2p.p2p_s, mooncake_cpu[name])
            parts = [(buckets, [gather, produce, wire])]
        elif name == "gather-free":
            free, gathered = way["gather_free_bytes"], way["gathered_bytes"]
            share = gathered / (free + gathered)
            gathers_s = gather.seconds if gathered else 0.0
            own = [produce.scaled(1 - share),
                   Step(WIRE, p2p.floor_s, mooncake_cpu[name]).scaled(1 - share)]
            parts = [(units((1 - share) * max_sent), own)]
            if gathered:  # then the gathered groups (fp8: the quantized ones), on p2p's plan
                wire = Step(WIRE, p2p.p2p_s, mooncake_cpu["p2p"])
                parts.append((chunks_of(round(share * model_bytes), bucket), [
                    gather, produce.scaled(share), wire.scaled(share)]))
        elif name in wires:  # one thread gathers a bucket, packs it, starts its broadcast
            wire = Step(WIRE, wires[name], model_bytes * engine_ranks * socket_cost["gloo"])
            parts = [(buckets, [Step(MAIN, gather.seconds, gather.cpu_seconds), produce, wire])]
        else:
            continue
        jobs = [[step.scaled(chunk) for step in steps] for chunks, steps in parts for chunk in chunks]
        shared = shared_seconds(jobs, cores)
        predicted = control + shared
        error = predicted / way["seconds"] - 1
        out["ways"][name] = {
            "gathers_s": gathers_s, "production_s": production,
            "wire_s": sum(s.seconds for _, steps in parts for s in steps if s.resource == WIRE),
            "cpu_seconds": sum(s.cpu_seconds for job in jobs for s in job), "shared_s": shared,
            "control_s": control, "predicted_s": predicted, "measured_s": way["seconds"],
            "error": error, "within_tolerance": abs(error) <= TOLERANCE,
        }
    return out
