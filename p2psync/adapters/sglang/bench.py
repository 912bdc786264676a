"""Benchmark (not a test): how fast the sglang layouts produce a rank's bytes, copy map against replica.

    python -m p2psync.adapters.sglang.bench [--hidden 1024] [--layers 8] [--tp 2] [--repeat 3]

One Qwen3-style model of random float32 HF tensors (the trainer's), bfloat16
engine ranks. Each layout runs in its own process so that its peak RSS is its
own; memcpy of the same number of output bytes on the same machine is the
ceiling. Reported: GB/s of produced bytes, the one-time build (trace, probes,
compile), and the peak RSS above what the process held before building the layout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time
from typing import Any


def hf_config(hidden: int, layers: int) -> dict[str, Any]:
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
    )
    return json.loads(config.to_json_string(use_diff=False))


def hf_tensors(config: dict[str, Any]) -> dict[str, Any]:
    """Random float32 tensors under the HF names (shapes from the transformers model built on meta)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        names = {n: t.shape for n, t in Qwen3ForCausalLM(Qwen3Config.from_dict(config)).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=generator) for n, shape in names.items()}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_layout(mode: str, hidden: int, layers: int, tp: int, repeat: int, results: Any) -> None:
    """Build rank 0's layout in `mode` and time filling every group, `repeat` times."""
    import torch

    from ...core.types import ParamSpec, TargetParam, TargetTable
    from .key import layout_key
    from .layout import SglangLayout
    from .shim import RankSpec, build_rank_model, require_sglang

    torch.set_num_threads(1)
    version = require_sglang()
    config = hf_config(hidden, layers)
    tensors = hf_tensors(config)
    meta = build_rank_model(RankSpec(config, tp, 1, "bfloat16", 0), "meta")
    key = layout_key(meta.server_args, config, "bfloat16", version)
    table = TargetTable(
        "bench", 0, tp, "sglang", key, "none", {}, "",
        tuple(TargetParam(n, tuple(p.shape), "bfloat16", 0, p.numel() * 2) for n, p in meta.model.named_parameters()),
    )
    del meta
    specs = {n: ParamSpec(n, tuple(t.shape), "float32") for n, t in tensors.items()}
    before = _rss_mib()
    start = time.perf_counter()
    layout = SglangLayout(table, specs, mode=mode, version=version)
    built = time.perf_counter() - start
    groups = layout.groups()
    out = torch.empty(max(g.nbytes for g in groups), dtype=torch.uint8)
    produced, seconds = 0, float("inf")
    for _ in range(repeat):
        start, produced = time.perf_counter(), 0
        for group in groups:
            produced += sum(r.nbytes for r in layout.fill(group, tensors, out[: group.nbytes]))
        seconds = min(seconds, time.perf_counter() - start)
    results.put({
        "what": f"{mode} layout", "bytes": produced, "seconds": seconds, "build_s": built,
        "peak_rss_above_mib": _rss_mib() - before,
    })


def memcpy(nbytes: int, repeat: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    seconds = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        seconds = min(seconds, time.perf_counter() - start)
    return {"what": "memcpy", "bytes": nbytes, "seconds": seconds, "build_s": 0.0, "peak_rss_above_mib": 0.0}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("copy_map", "replica"):
        results = ctx.Queue()
        process = ctx.Process(target=run_layout, args=(mode, args.hidden, args.layers, args.tp, args.repeat, results))
        process.start()
        rows.append(results.get())
        process.join()
    rows.append(memcpy(rows[0]["bytes"], args.repeat))
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, TP rank 0 of {args.tp}: float32 HF tensors -> bfloat16 bytes, 1 thread")
    print(f"{'':16}{'bytes':>14}{'GB/s':>8}{'build s':>9}{'peak RSS +MiB':>15}")
    for r in rows:
        print(f"{r['what']:16}{r['bytes']:>14,}{r['bytes'] / r['seconds'] / 1e9:>8.2f}{r['build_s']:>9.1f}{r['peak_rss_above_mib']:>15.0f}")
    return rows


if __name__ == "__main__":
    main()
