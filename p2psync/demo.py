"""`p2psync demo`: FSDP2 trainer ranks updating torch engines over a transport, on one machine.

Each engine is its own process holding a transformers model; each trainer rank is a
process in a gloo world training the same architecture with FSDP2. After every training
step the trainer syncs its weights into the engines, verifies them by digest, and checks
that a greedy generation on each engine equals the trainer's own. It is one world of
`p2psync.worlds`, the runtime the conformance round trips also run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from .trainer.options import SessionOptions
from .worlds import ModelSpec, RunResult, WorldOptions, run_world
from .worlds.launch import free_port
from .worlds.options import trainer_kind

#: Model sizes: a ~100M-parameter Qwen3-style model for the demo, a tiny one for tests.
CONFIGS: dict[str, dict[str, Any]] = {
    "100m": dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    ),
}


@dataclass
class DemoOptions:
    """What one demo run does."""

    size: str = "100m"
    trainers: int = 2
    engines: int = 2
    updates: int = 3
    transport: str = "mooncake"
    #: "cpu", "cuda" (engines and trainer ranks on GPUs, NCCL, pinned buffers) or "auto".
    device: str = "cpu"
    #: How the sessions move weights.
    session: SessionOptions = field(default_factory=lambda: SessionOptions(bucket_bytes=64 << 20, check=True))
    progress: bool = True
    job_id: str = field(default_factory=lambda: f"demo-{os.getpid()}-{int(time.time())}")
    #: The port of the job's rendezvous on 127.0.0.1, where `p2psync status` finds its engines.
    rendezvous_port: int = field(default_factory=free_port)


def world_options(opts: DemoOptions) -> WorldOptions:
    """The demo as a world: torch engines holding the demo's Qwen3, FSDP2 trainers updating them
    as a Session does by default (gather-free: the world checks that nothing was gathered), one
    transport."""
    return WorldOptions(
        engine="torch", engines=opts.engines, runs=((trainer_kind("fsdp2", "gather-free"), opts.transport),),
        trainers=opts.trainers,
        model=ModelSpec("qwen3", CONFIGS[opts.size]), updates=opts.updates, device=opts.device,
        session=opts.session, generate=True,
        progress=opts.progress, job_id=opts.job_id, rendezvous_port=opts.rendezvous_port,
    )


def run(opts: DemoOptions) -> RunResult:
    """Start engines and trainers, run the updates, stop everything; the run's reports and
    generations (the trainer's and each engine's, per update).

    Raises RuntimeError if any process failed.
    """
    (result,) = run_world(world_options(opts)).values()
    if result.error:
        raise RuntimeError(result.error)
    return result
