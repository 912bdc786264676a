"""Public end-to-end weight-update figures and their setups, as plannable presets.

Each `Setup` is a model preset on a cluster, with the update times its authors published
and the way they measured (`broadcast`: NCCL broadcast from the trainer; `p2p`: point to
point after trainer gathers; `gather-free`: every trainer rank sends its own shard). Where
a setup's parallelism was not published, the cluster here is an assumption and `assumed`
says which parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster


@dataclass(frozen=True)
class Published:
    """One published time: the way measured, seconds (low, high), and who measured it how."""

    way: str  # "broadcast", "p2p" or "gather-free": the predicted way it is compared with
    low_s: float
    high_s: float
    system: str


@dataclass(frozen=True)
class Setup:
    name: str
    model: str  # a `presets.PRESETS` name
    cluster: dict[str, Any]  # `Cluster` keyword arguments
    published: tuple[Published, ...]
    hardware: str
    assumed: str = ""  # which parts of the cluster were not published
    group: str = ""  # "miles": a row of miles' table
    notes: tuple[str, ...] = field(default_factory=tuple)

    def make_cluster(self, **links: Any) -> Cluster:
        return Cluster(**self.cluster, **links)


def _miles(name: str, model: str, nodes: int, trainer: tuple[int, int, int, int], engine: tuple[int, int], dtype: str,
           broadcast_s: float, p2p_s: float, assumed: str = "", note: str = "") -> Setup:
    """A row of miles' table: trainer TP, PP, CP, EP on `nodes` nodes; engines of TP, EP on as many."""
    tp, pp, _, ep = trainer
    etp, eep = engine
    return Setup(
        name=name, model=model, group="miles",
        cluster=dict(train_ranks=nodes * 8, train_tp=tp, train_pp=pp, train_ep=ep, engines=max(1, nodes * 8 // etp),
                     engine_tp=etp, engine_ep=eep, engine_dtype=dtype),
        published=(Published("broadcast", broadcast_s, broadcast_s, "miles NCCL broadcast"),
                   Published("p2p", p2p_s, p2p_s, "miles P2P (Mooncake RDMA, CPU replica)")),
        hardware=f"H100, {nodes} node{'s' if nodes > 1 else ''} each side", assumed=assumed,
        notes=(note,) if note else (),
    )


SETUPS: tuple[Setup, ...] = (
    _miles("miles Qwen3-30B-A3B", "Qwen3-30B-A3B", 2, (4, 1, 1, 8), (8, 8), "bf16", 2.7, 2.2),
    _miles("miles GLM-4.7-Flash", "GLM-4.7-Flash", 1, (1, 1, 1, 8), (4, 4), "bf16", 2.5, 4.2,
           assumed="trainer TP1 EP8 and bf16 engines (miles publishes 1 node, engines TP4 EP4)",
           note="miles' P2P is slower than its broadcast here: its CPU replica load"),
    _miles("miles GLM-4.5-Air", "GLM-4.5-Air", 4, (1, 4, 1, 8), (8, 8), "bf16", 5.0, 2.6),
    _miles("miles Qwen3-235B-A22B", "Qwen3-235B-A22B", 8, (4, 4, 2, 16), (32, 32), "bf16", 10.8, 3.2),
    _miles("miles GLM-5", "GLM-5", 16, (4, 8, 2, 16), (64, 64), "bf16", 58.3, 8.5, assumed="bf16 engines"),
    _miles("miles Kimi-K2", "Kimi-K2", 32, (8, 8, 4, 32), (32, 32), "fp8", 53.3, 7.2),
    Setup(
        name="Perplexity Kimi-K2", model="Kimi-K2",
        cluster=dict(train_ranks=256, train_tp=8, train_pp=8, train_ep=32, engines=4, engine_tp=32, engine_ep=32,
                     engine_dtype="fp8"),
        published=(Published("gather-free", 1.3, 1.3, "Perplexity RDMA P2P (one-sided writes, static schedule)"),),
        hardware="256 training H100 (bf16) -> 128 inference H100 (fp8)",
        assumed="trainer TP8 PP8 EP32 (as miles) and 4 engines of TP32 EP32",
    ),
    Setup(
        name="vLLM sharded_rdt Qwen3-235B", model="Qwen3-235B-A22B",
        cluster=dict(train_ranks=8, train_tp=8, train_ep=8, engines=1, engine_tp=8, engine_ep=8,
                     engine_dp_attention=True),
        published=(Published("gather-free", 3.2, 3.3, "vLLM sharded_rdt (receiver-baked slices)"),),
        hardware="8 H100 -> 8 H100, engine DP8 EP8",
        assumed="trainer sharded over its 8 GPUs (TP8 EP8 here); engine DP attention modelled as every rank "
                "holding the whole attention",
    ),
    Setup(
        name="NeMo-RL DeepSeek-V3", model="DeepSeek-V3",
        cluster=dict(train_ranks=256, train_pp=16, train_ep=16, engines=8, engine_tp=32, engine_ep=32),
        published=(Published("gather-free", 7.65, 9.94, "NeMo-RL nccl_reshard (shard to shard)"),),
        hardware="H100; trainer PP16 EP16 -> vLLM TP32 x DP8",
        assumed="bf16 engines, experts over EP32 inside each TP32 engine",
    ),
)


def setup(name: str) -> Setup:
    for s in SETUPS:
        if s.name == name:
            return s
    raise ValueError(f"unknown setup {name!r}; choose from {', '.join(s.name for s in SETUPS)}")
