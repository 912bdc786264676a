"""The cluster a plan runs on: trainer and engine parallelism, nodes, NICs, dtypes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from math import ceil


@dataclass(frozen=True)
class Cluster:
    train_ranks: int
    train_tp: int = 1
    train_pp: int = 1
    train_ep: int = 1
    train_etp: int = 1
    engines: int = 1
    engine_tp: int = 8
    engine_ep: int = 1
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 400.0  # per NIC, per direction
    engine_dtype: str = "bf16"  # bf16 or fp8
    engine_dp_attention: bool = False  # every engine rank holds the whole attention
    trainer_dtype: str = "bf16"
    latency_us: float = 5.0  # per message (one parameter write, one broadcast chunk hop)
    #: All-gather bus bandwidth inside a node, GB/s per GPU (NVLink); across nodes a GPU's share of the NICs.
    nvlink_gbytes: float = 360.0

    def __post_init__(self) -> None:
        for name in ("train_ranks", "train_tp", "train_pp", "train_ep", "train_etp", "engines", "engine_tp",
                     "engine_ep", "gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.train_ranks % self.train_pp:
            raise ValueError(f"train ranks {self.train_ranks} do not divide into {self.train_pp} pipeline stages")
        if self.train_ranks % (self.train_tp * self.train_pp):
            raise ValueError(
                f"train ranks {self.train_ranks} are not a multiple of TP x PP = {self.train_tp * self.train_pp}"
            )
        if self.stage_size % (self.train_ep * self.train_etp):
            raise ValueError(
                f"a pipeline stage of {self.stage_size} ranks does not hold EP x ETP = {self.train_ep * self.train_etp}"
            )
        if self.engine_tp % self.engine_ep:
            raise ValueError(f"engine EP {self.engine_ep} must divide engine TP {self.engine_tp} (sglang's MoE layout)")
        if self.nvlink_gbytes <= 0 or self.nic_gbps <= 0:
            raise ValueError("link bandwidths must be positive")
        if self.engine_dtype not in ("bf16", "fp8"):
            raise ValueError("engine dtype must be bf16 or fp8")

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8

    @property
    def nic_share_bytes_per_s(self) -> float:
        """One GPU's share of its node's NICs, per direction: what a cross-node all-gather gets per rank."""
        return self.nic_bytes_per_s * min(self.nics_per_node, self.gpus_per_node) / self.gpus_per_node

    def group_bytes_per_s(self, span: int) -> float:
        """All-gather bandwidth per rank of a group of `span` consecutive ranks: NVLink when the
        group fits in a node, else the GPU's share of the NICs."""
        return self.nvlink_gbytes * 1e9 if span <= self.gpus_per_node else self.nic_share_bytes_per_s

    @property
    def stage_size(self) -> int:
        return self.train_ranks // self.train_pp

    @property
    def engine_ranks(self) -> int:
        return self.engines * self.engine_tp

    @property
    def train_nodes(self) -> int:
        return ceil(self.train_ranks / self.gpus_per_node)

    @property
    def engine_nodes(self) -> int:
        return ceil(self.engine_ranks / self.gpus_per_node)

    def stage_ranks(self, stage: int) -> range:
        """Megatron's default rank order (tp-cp-ep-dp-pp): PP outermost, a stage is a contiguous block."""
        return range(stage * self.stage_size, (stage + 1) * self.stage_size)

    def stage_layers(self, stage: int, n_layers: int) -> range:
        """Layers split evenly over the stages; the first `n_layers % pp` stages take one more."""
        base, extra = divmod(n_layers, self.train_pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def trainer_nic(self, rank: int) -> tuple[str, int, int]:
        return ("trainer", rank // self.gpus_per_node, (rank % self.gpus_per_node) % self.nics_per_node)

    def engine_nic(self, engine: int, rank: int) -> tuple[str, int, int]:
        g = engine * self.engine_tp + rank  # engines packed onto their own nodes, in order
        return ("engine", g // self.gpus_per_node, (g % self.gpus_per_node) % self.nics_per_node)

    def layout_key_text(self, source: str) -> str:
        """Engines of equal parallelism share layout keys, so their equal ranks share plan units."""
        return json.dumps({"engine": "sglang", "shapes": source, "tp_size": self.engine_tp, "ep_size": self.engine_ep,
                           "dtype": self.engine_dtype, "dp_attention": self.engine_dp_attention}, sort_keys=True)

    def to_dict(self) -> dict:
        return {**asdict(self), "train_nodes": self.train_nodes, "engine_nodes": self.engine_nodes,
                "engine_ranks": self.engine_ranks, "stage_size": self.stage_size}
