"""The real plan at cluster scale, its loads, and predicted update times under a stated link model.

Link model (stated in every output):
- every NIC moves `nic_gbps` per direction (full duplex) and NICs work in parallel;
  a rank uses NIC `local_rank % nics_per_node` of its node;
- P2P: time = max over NICs and directions of (bytes through it / bandwidth +
  messages through it x latency), a message being one parameter written to one
  target; all pipeline stages' senders send at once. Lower bound: the most bytes
  through one NIC over its bandwidth.
- broadcast (miles/slime/verl default): per pipeline stage, its head rank sends the
  full gathered tensors (engine dtype) to every engine rank, the stages at once.
  "ring" (default) models NCCL's pipelined ring broadcast: every rank of the ring
  receives each byte once and forwards it once, so an engine rank's NIC carries the
  whole model; time = most bytes through a NIC / bandwidth + (tensors + ring
  length) x latency. "star" has the head send to each engine rank in turn: its NIC
  carries stage bytes x engine ranks. "tree" is gloo's broadcast, a binomial tree over
  the head (member 0) and the engine ranks (members 1...): member i sends to i + 2^k for
  every 2^k > i, so the head's NIC carries stage bytes x ceil(log2 members).
The wire only: `update.whole_update` adds the trainer's gathers, the production of the
bytes and the engines' control calls.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..trainer.plan import Plan, PlanTarget, build_plan, unit_of
from ..core.types import TargetId
from .cluster import Cluster
from .shapes import ShapeModel

LINK_MODEL = (
    "each NIC {gbps:g} Gb/s per direction, full duplex; rank -> NIC local_rank % {nics}; "
    "P2P time = max over NIC-directions of bytes/bandwidth + messages x {lat:g} us (message = one parameter to one "
    "target), all stages at once; broadcast ({bmodel}) = one head rank per stage sends full tensors to every engine "
    "rank (engine dtype), stages at once{bnote}; the wire only (`update` adds gathers, production and control)"
)
_BNOTE = {
    "ring": " (NCCL pipelined ring: each engine-rank NIC receives and forwards every byte once; + (tensors + ring "
            "length) x latency)",
    "star": " (star: the head NIC carries stage bytes x engine ranks)",
    "tree": " (gloo's binomial tree: the head NIC carries stage bytes x ceil(log2 members); + log2 hops x latency)",
}


def tree_sends(member: int, members: int) -> int:
    """How many members a binomial-tree broadcast's `member` sends to: i + 2^k for every 2^k > i
    that is a member (gloo's broadcast; member 0 is the root)."""
    return sum(1 for k in range(members.bit_length()) if 2**k > member and member + 2**k < members)


@dataclass
class Prediction:
    cluster: Cluster
    shapes: ShapeModel
    plans: list[Plan]
    sender_bytes: dict[int, int]
    receiver_bytes: dict[TargetId, int]
    nic_send: dict[tuple[str, int, int], int]
    nic_recv: dict[tuple[str, int, int], int]
    nic_msgs: dict[tuple[str, int, int, str], int]
    p2p_s: float
    lower_bound_s: float
    floor_s: float
    broadcast_s: float
    broadcast_model: str
    bcast_nic_send: dict[tuple[str, int, int], int]
    bcast_nic_recv: dict[tuple[str, int, int], int]
    stage_full_bytes: list[int]
    build_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def link_model(self) -> str:
        c = self.cluster
        return LINK_MODEL.format(gbps=c.nic_gbps, nics=c.nics_per_node, lat=c.latency_us,
                                 bmodel=self.broadcast_model, bnote=_BNOTE[self.broadcast_model])


def predict(cluster: Cluster, shapes: ShapeModel, broadcast_model: str = "ring", t0: float | None = None) -> Prediction:
    """Build the real plan once per sender group (pipeline stage) and derive loads and times."""
    t0 = time.perf_counter() if t0 is None else t0
    c = cluster
    n_layers = len(shapes.layer_kinds)
    if len(shapes.ranks) != c.engine_tp:
        raise ValueError(f"shapes hold {len(shapes.ranks)} engine ranks, the engines have {c.engine_tp}")
    key = c.layout_key_text(shapes.source)
    bw, lat = c.nic_bytes_per_s, c.latency_us * 1e-6
    plans: list[Plan] = []
    sender_bytes: dict[int, int] = defaultdict(int)
    receiver_bytes: dict[TargetId, int] = defaultdict(int)
    nic_send: dict[tuple[str, int, int], int] = defaultdict(int)
    nic_recv: dict[tuple[str, int, int], int] = defaultdict(int)
    nic_msgs: dict[tuple[str, int, int, str], int] = defaultdict(int)
    stage_full: list[tuple[int, int]] = []
    for stage in range(c.train_pp):
        layers = c.stage_layers(stage, n_layers)
        first, last = stage == 0, stage == c.train_pp - 1
        per_rank = [shapes.rank_bytes(r, layers, first, last) for r in range(c.engine_tp)]
        stage_full.append(shapes.full_bytes(layers, first, last))
        targets = [
            PlanTarget(TargetId(f"engine-{e}", r), unit_of(key, r), per_rank[r][0])
            for e in range(c.engines) for r in range(c.engine_tp)
        ]
        plan = build_plan(list(c.stage_ranks(stage)), targets)
        plans.append(plan)
        for target, sender in plan.assignment.items():
            nbytes, count = per_rank[target.rank]
            e = int(target.engine_id.rpartition("-")[2])
            sender_bytes[sender] += nbytes
            receiver_bytes[target] += nbytes
            snic, rnic = c.trainer_nic(sender), c.engine_nic(e, target.rank)
            nic_send[snic] += nbytes
            nic_recv[rnic] += nbytes
            nic_msgs[(*snic, "send")] += count
            nic_msgs[(*rnic, "recv")] += count
    for s in range(c.train_ranks):
        sender_bytes.setdefault(s, 0)

    def t_of(nic: tuple[str, int, int], direction: str, nbytes: int) -> float:
        return nbytes / bw + nic_msgs[(*nic, direction)] * lat

    p2p = max([t_of(n, "send", b) for n, b in nic_send.items()] + [t_of(n, "recv", b) for n, b in nic_recv.items()])
    most = max([*nic_send.values(), *nic_recv.values()])
    trainer_nics = c.train_nodes * min(c.nics_per_node, c.gpus_per_node)
    floor = max(max(nic_recv.values()), sum(nic_send.values()) / trainer_nics) / bw

    # Broadcast path.
    b_send: dict[tuple[str, int, int], int] = defaultdict(int)
    b_recv: dict[tuple[str, int, int], int] = defaultdict(int)
    engine_nics = [c.engine_nic(e, r) for e in range(c.engines) for r in range(c.engine_tp)]
    max_tensors = 0
    for stage, (full, count) in enumerate(stage_full):
        head = c.trainer_nic(c.stage_ranks(stage)[0])
        max_tensors = max(max_tensors, count)
        if broadcast_model == "ring":
            b_send[head] += full
            for i, nic in enumerate(engine_nics):
                b_recv[nic] += full
                if i < len(engine_nics) - 1:
                    b_send[nic] += full
        elif broadcast_model == "star":
            b_send[head] += full * len(engine_nics)
            for nic in engine_nics:
                b_recv[nic] += full
        elif broadcast_model == "tree":
            members = 1 + len(engine_nics)
            b_send[head] += full * tree_sends(0, members)
            for i, nic in enumerate(engine_nics):
                b_recv[nic] += full
                b_send[nic] += full * tree_sends(1 + i, members)
        else:
            raise ValueError(f"broadcast model must be ring, star or tree, not {broadcast_model!r}")
    b_most = max([*b_send.values(), *b_recv.values()])
    hops = {"ring": len(engine_nics) + 1, "star": 1, "tree": len(engine_nics).bit_length()}[broadcast_model]
    msgs = max_tensors * {"ring": 1, "star": len(engine_nics), "tree": tree_sends(0, 1 + len(engine_nics))}[
        broadcast_model]
    broadcast = b_most / bw + (msgs + hops) * lat
    return Prediction(
        cluster=c, shapes=shapes, plans=plans, sender_bytes=dict(sender_bytes), receiver_bytes=dict(receiver_bytes),
        nic_send=dict(nic_send), nic_recv=dict(nic_recv), nic_msgs=dict(nic_msgs), p2p_s=p2p,
        lower_bound_s=most / bw, floor_s=floor, broadcast_s=broadcast, broadcast_model=broadcast_model,
        bcast_nic_send=dict(b_send), bcast_nic_recv=dict(b_recv), stage_full_bytes=[f for f, _ in stage_full],
        build_s=time.perf_counter() - t0,
    )
