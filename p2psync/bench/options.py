"""What one bench run does: kept apart from the runner, so that the bench's engine ranks read
it without importing the runner that imports them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..demo import DemoOptions
from ..trainer.options import SessionOptions
from .cluster import Topology


#: The bench's trainers, and how its report names each.
TRAINERS = {"fsdp2": "FSDP2", "megatron": "Megatron-Core (TP = EP = ranks)"}


@dataclass
class BenchOptions(DemoOptions):
    """What one bench run does: the demo's model, trainers, engines and transport, the trainer
    (`TRAINERS`), the engine kind (`engines.KINDS`) and its ranks per engine, its fp8 quantizer if any, the ways
    to compare (empty: all the engines offer), untimed warm-up updates per way, the size of the raw measurements,
    and the cluster in a box it runs in, if any."""

    engine: str = "torch"
    engine_tp: int = 2
    #: The trainer: "fsdp2" (dim-0 shards) or "megatron" (Megatron-Core, TP over the trainer
    #: ranks and EP over them for the experts; sglang and vLLM engines' Qwen3-MoE).
    trainer: str = "fsdp2"
    ways: tuple[str, ...] = ()
    warmup: int = 1
    raw_bytes: int = 512 << 20
    session: SessionOptions = field(default_factory=lambda: SessionOptions(bucket_bytes=64 << 20))
    #: The torch engines' parameter dtype (e.g. "bfloat16"); None: the trainer's float32.
    engine_dtype: str | None = None
    #: `--fp8`: sglang engines serve an fp8 checkpoint quantized by this quantizer
    #: (`p2psync.layouts.quantizers`), and every way quantizes on the trainer (see `fp8`); None: bf16.
    fp8: str | None = None
    #: `--delta`: the learning rates whose AdamW steps the delta bench takes (see `delta`).
    delta_lrs: tuple[float, ...] = (1e-6, 1e-5)
    #: `--cluster`: run as emulated nodes in a cluster in a box (None: plain processes on loopback).
    cluster: Topology | None = None
    job_id: str = field(default_factory=lambda: f"bench-{os.getpid()}-{int(time.time())}")
