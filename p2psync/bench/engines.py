"""The bench's engines and trainer model, per engine kind.

`torch`: one process per engine holding the demo's dense Qwen3 model (the
identity layout: every engine rank holds full tensors, trainer dtype). `sglang`:
`engine_tp` processes per engine, each sglang's model of one TP rank of a
Qwen3-MoE in bfloat16, so that p2psync sends each rank only its shard while the
broadcast path sends full tensors that each rank's loader slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .broadcast import Load

if TYPE_CHECKING:
    import torch

    from ..core.endpoint import EngineEndpoint
    from ..core.rendezvous import Rendezvous
    from .runner import BenchOptions

KINDS = ("torch", "sglang")


@dataclass(frozen=True)
class EngineRank:
    """One engine-rank process: its endpoint, and what it does with full HF tensors."""

    endpoint: EngineEndpoint
    load: Load


def sizes(kind: str) -> list[str]:
    """Model sizes an engine kind runs."""
    if kind == "torch":
        from ..demo import CONFIGS

        return sorted(CONFIGS)
    from .model import MOE_CONFIGS

    return sorted(MOE_CONFIGS)


def tp(opts: BenchOptions) -> int:
    """Ranks per engine."""
    return 1 if opts.engine == "torch" else opts.engine_tp


def engine_ids(opts: BenchOptions) -> list[str]:
    prefix = "engine" if opts.engine == "torch" else opts.engine
    return [f"{prefix}-{i}" for i in range(opts.engines)]


def member(opts: BenchOptions, index: int) -> tuple[str, int]:
    """Engine id and rank of engine-rank process `index`."""
    return engine_ids(opts)[index // tp(opts)], index % tp(opts)


def broadcast_dtype(opts: BenchOptions) -> str | None:
    """The dtype the broadcast path sends (the engines'); None: the trainer's own."""
    return None if opts.engine == "torch" else "bfloat16"


def start_rank(index: int, opts: BenchOptions, port: int) -> EngineRank:
    """Build and serve engine-rank process `index`."""
    import torch

    if opts.engine == "torch":
        from ..conformance.harness import start_engine
        from ..demo import world_options

        endpoint = start_engine(index, world_options(opts), port).endpoint
        assert endpoint is not None
        params = endpoint.params

        def copy(items: Sequence[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in items:
                params[name].copy_(tensor)

        return EngineRank(endpoint, copy)
    from ..adapters.sglang.bench_rank import start_rank as start_sglang
    from ..core.logs import configure
    from ..core.rendezvous import Rendezvous
    from .model import hf_config

    engine_id, rank = member(opts, index)
    configure(f"{engine_id} rank {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    endpoint, load = start_sglang(
        hf_config(opts.size), tp(opts), rank, engine_id=engine_id, rendezvous=rendezvous, transport=opts.transport
    )
    return EngineRank(endpoint, load)


def start_trainer(rank: int, opts: BenchOptions, port: int) -> tuple[Rendezvous, Any]:
    """Join the trainer world; return the rendezvous and the FSDP2 source of the model."""
    from ..adapters.fsdp2 import FSDP2Source
    from ..conformance.harness import join_trainer_world, start_fsdp2
    from ..demo import world_options

    if opts.engine == "torch":
        rendezvous, module = start_fsdp2(rank, world_options(opts), port)
        return rendezvous, FSDP2Source(module)
    from . import model

    rendezvous = join_trainer_world(rank, opts, port)
    module = model.build(opts.size)
    model.shard(module)
    return rendezvous, FSDP2Source(module, name_map=model.hf_name)
