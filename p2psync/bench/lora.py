"""`p2psync bench --lora`: a LoRA adapter's update against the full update of the same model,
in one run: the bytes each engine rank receives and each update's median time.

One trainer rank (the demo's Qwen3 with a LoRA adapter on every linear projection of each
decoder layer) updates one engine process that holds the model twice: whole (a full update
from the trainer's base weights) and with an adapter slot (a LoRA update of the adapter only).
The adapter changes between updates; the last LoRA update is verified against PEFT's own
state dict of the trainer's adapter.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

from ..demo import CONFIGS
from .options import BenchOptions

#: The adapter's rank in the bench (alpha twice that).
LORA_RANK = 16


def run_lora_bench(opts: BenchOptions) -> dict[str, Any]:
    """Both ways, `opts.warmup` untimed and `opts.updates` timed updates each, alternating."""
    from ..adapters.fsdp2 import FSDP2Source
    from ..adapters.peft import LoraSource
    from ..core.control import post
    from ..core.rendezvous import Rendezvous
    from ..trainer.session import Session
    from ..worlds.lora import adapter_bytes, lora_bench_engine, with_adapter
    from ..worlds.world import unavailable

    if reason := unavailable("trainer_sources", "peft-lora"):
        raise ValueError(f"--lora needs PEFT (pip install 'p2psync[lora]'): {reason}")
    config = CONFIGS[opts.size]
    trainer = with_adapter(config, seed=2, rank=LORA_RANK)
    # the full update's source: the trainer's base weights under their HF names, no adapter
    base = FSDP2Source(trainer.get_base_model(), name_map=lambda n: n.replace(".base_layer", ""),
                       select=lambda n: ".lora_" not in n)
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="lora-bench", is_server=True, timeout=300)
    context = mp.get_context("spawn")
    stop = context.Event()
    engine = context.Process(target=lora_bench_engine, daemon=True,
                             args=(rendezvous.port, rendezvous.job_id, opts.transport, config, LORA_RANK, stop))
    engine.start()
    seconds: dict[str, list[float]] = {"full": [], "lora": []}
    rank_bytes: dict[str, int] = {}
    try:
        with Session(source=base, transport=opts.transport, rendezvous=rendezvous, options=opts.session) as full, \
             Session(source=LoraSource(trainer), transport=opts.transport, rendezvous=rendezvous,
                     options=opts.session) as lora:
            full.connect(["full"])
            lora.connect(["lora"])
            for n in range(opts.warmup + opts.updates):
                _step(trainer, n)
                for way, session in (("full", full), ("lora", lora)):
                    started = time.perf_counter()
                    report = session.update(f"{way}-{n}")
                    took = time.perf_counter() - started
                    if not report.ok:
                        raise RuntimeError(f"the {way} update failed: {report.format()}")
                    if n >= opts.warmup:
                        seconds[way].append(took)
                    rank_bytes[way] = report.engines[way].rank_bytes[0]
            held = post(lora.tables["lora"][0].control_url, "adapter", token=lora.token, timeout=300)
        verified = held == adapter_bytes(trainer)
    finally:
        stop.set()
        engine.join(30)
        if engine.is_alive():
            engine.kill()
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    return {
        "bench": "lora", "size": opts.size, "transport": opts.transport, "lora_rank": LORA_RANK,
        "updates": opts.updates, "rank_bytes": rank_bytes, "seconds": medians,
        "bytes_ratio": rank_bytes["full"] / rank_bytes["lora"], "speedup": medians["full"] / medians["lora"],
        "verified": verified,
    }


def _step(model: Any, n: int) -> None:
    """A change of every element of the adapter (the base weights stay: a LoRA run trains none)."""
    import torch

    generator = torch.Generator().manual_seed(100 + n)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 1e-3)


def format_lora(result: dict[str, Any]) -> str:
    rows = [f"LoRA bench: {result['size']} Qwen3, adapter rank {result['lora_rank']} on every linear projection, "
            f"{result['transport']}, median of {result['updates']} updates",
            f"  {'way':<6} {'bytes per engine rank':>22} {'seconds':>9}"]
    for way in ("full", "lora"):
        rows.append(f"  {way:<6} {result['rank_bytes'][way]:>22,} {result['seconds'][way]:>9.3f}")
    rows.append(f"  the LoRA update moves 1/{result['bytes_ratio']:.1f} of the bytes, "
                f"{result['speedup']:.1f}x faster; {'verified' if result['verified'] else 'NOT VERIFIED'} "
                "(the engine's adapter equals PEFT's state dict of the trainer's)")
    return "\n".join(rows)
