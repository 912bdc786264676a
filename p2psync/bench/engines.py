"""The bench's engines and trainer model, per engine kind.

`torch`: one process per engine holding the demo's dense Qwen3 model (the identity
layout: every engine rank holds full tensors, trainer dtype). `sglang` and `vllm`:
`engine_tp` processes per engine, each the engine's own model of one TP rank of a
Qwen3-MoE in bfloat16, or for sglang with `--fp8` of its fp8 checkpoint (see `fp8`; through
the adapter's public `serve_rank`), so that p2psync sends
each rank only its shard while the broadcast path sends full tensors that each rank's
own loader slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .broadcast import Load

if TYPE_CHECKING:
    import torch

    from ..worlds import WorldOptions
    from ..engine.endpoint import EngineEndpoint
    from ..core.rendezvous import Rendezvous
    from .options import BenchOptions

KINDS = ("torch", "sglang", "vllm")
#: The dtype of the MoE engines' parameters (torch engines hold the trainer's float32).
MOE_ENGINE_DTYPE = "bfloat16"


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


def engine_dtype(opts: BenchOptions) -> str | None:
    """The engines' parameter dtype where it is not the trainer's (None: the trainer's)."""
    return opts.engine_dtype if opts.engine == "torch" else MOE_ENGINE_DTYPE


def torch_world(opts: BenchOptions) -> WorldOptions:
    """The demo's world of torch engines, holding `opts.engine_dtype` where it is given."""
    from ..demo import world_options

    world = world_options(opts)
    return world if opts.engine_dtype is None else dataclasses.replace(world, engine_dtype=opts.engine_dtype)


def version(kind: str) -> str | None:
    """The engine library's version (None for torch engines, which are transformers models)."""
    if kind == "sglang":
        from ..adapters.sglang import version as sglang_version

        return sglang_version()
    if kind == "vllm":
        from ..adapters.vllm import version as vllm_version

        return vllm_version()
    return None


def start_rank(index: int, opts: BenchOptions, port: int) -> EngineRank:
    """Build and serve engine-rank process `index`."""
    import torch

    if opts.engine == "torch":
        from ..worlds import start_engine

        endpoint = start_engine(index, torch_world(opts), port).endpoint
        assert endpoint is not None
        params = endpoint.params

        def copy(items: Sequence[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in items:
                params[name].copy_(tensor)

        return EngineRank(endpoint, copy)
    from ..core.logs import configure
    from ..core.rendezvous import Rendezvous
    from .fp8 import engine_config

    if opts.engine == "sglang":
        from ..adapters.sglang import serve_rank
    else:
        from ..adapters.vllm import serve_rank
    engine_id, rank = member(opts, index)
    configure(f"{engine_id} rank {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    endpoint, load = serve_rank(
        engine_config(opts), tp=tp(opts), rank=rank, engine_id=engine_id, rendezvous=rendezvous,
        transport=opts.transport, dtype=MOE_ENGINE_DTYPE,
    )
    return EngineRank(endpoint, load)


def start_trainer(rank: int, opts: BenchOptions, port: int) -> tuple[Rendezvous, Any]:
    """Join the trainer world; return the rendezvous and the trainer source of the model:
    FSDP2's, or Megatron-Core's (TP and, for the experts, EP over every trainer rank)."""
    from ..adapters.fsdp2 import FSDP2Source
    from ..worlds import join_trainer_world, start_fsdp2

    if opts.engine == "torch":
        rendezvous, module = start_fsdp2(rank, torch_world(opts), port)
        return rendezvous, FSDP2Source(module)
    from . import model

    rendezvous = join_trainer_world(rank, opts, port)
    if opts.trainer == "megatron":
        from ..adapters.megatron import MegatronSource
        from ..worlds.megatron import Case, load_hf, megatron_model

        case = Case("qwen3_moe", tp=opts.trainers, ep=opts.trainers)
        module = megatron_model(case, model.hf_config(opts.size))
        load_hf(module, model.hf_tensors(opts.size), "qwen3_moe")  # replicated tensors (the router) equal on every rank
        return rendezvous, MegatronSource(module, "qwen3_moe")
    module = model.build(opts.size)
    model.shard(module)
    return rendezvous, FSDP2Source(module, name_map=model.hf_name)
