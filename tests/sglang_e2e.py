"""Processes of the sglang end-to-end test, launched by `p2psync.demo.launch`.

`DemoOptions.engines` counts engine-rank processes: process i is rank i % TP of
engine `sglang-{i // TP}`, each building sglang's model of its rank on CPU and
serving its live parameter memory. Trainers are the demo's FSDP2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TP = 2


def engine_ids(opts: Any) -> list[str]:
    return [f"sglang-{i}" for i in range(opts.engines // TP)]


def engine_config(size: str) -> dict[str, Any]:
    """The HF config of the demo's model, as sglang reads it."""
    from p2psync.demo import build_model

    config = build_model(size, seed=0).config
    config.architectures = ["Qwen3ForCausalLM"]
    return json.loads(config.to_json_string(use_diff=False))


def rank_bytes(opts: Any) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """After a run, per engine rank (`"sglang-0[1]"`): what sglang's own loader makes of the
    trainer's final HF tensors on that rank, and what the rank held (both read from `opts.dump_dir`)."""
    import torch
    from sglang_models import sglang_rank

    dump = Path(opts.dump_dir)
    trained = torch.load(dump / "trainer.pt")
    out = {}
    for rank in range(TP):
        expected, _ = sglang_rank(engine_config(opts.size), TP, 1, rank, trained)
        for engine in engine_ids(opts):
            out[f"{engine}[{rank}]"] = (expected, torch.load(dump / f"{engine}-rank{rank}.pt"))
    return out


def engine_rank(index: int, opts: Any, port: int, stop: Any) -> None:
    """One sglang rank: its model on CPU (parameters prefilled with 0xA5 bytes), served until `stop`."""
    import torch

    from p2psync.adapters.sglang import serve
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model
    from p2psync.core.logs import configure
    from p2psync.core.rendezvous import Rendezvous

    engine_id, rank = f"sglang-{index // TP}", index % TP
    configure(f"{engine_id} rank {rank}")
    torch.set_num_threads(1)
    rank_model = build_rank_model(RankSpec(engine_config(opts.size), TP, 1, "bfloat16", rank), "cpu")
    for p in rank_model.model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    endpoint = serve(
        rank_model.model, rank_model.server_args, rank_model.model_config,
        engine_id=engine_id, rank=rank, rendezvous=rendezvous, transport=opts.transport,
    )
    stop.wait()
    held = {name: p.data.clone() for name, p in rank_model.model.named_parameters()}
    torch.save(held, Path(opts.dump_dir) / f"{engine_id}-rank{rank}.pt")
    endpoint.close()


def trainer(rank: int, opts: Any, port: int, results: Any) -> None:
    """One FSDP2 rank: train a step and update every engine, `opts.updates` times; save the final weights."""
    import torch
    import torch.distributed as dist

    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.core.session import Session
    from p2psync.demo import start_trainer

    rendezvous, model = start_trainer(rank, opts, port)
    for engine in engine_ids(opts):  # engines build sglang models first: wait longer than connect does
        rendezvous.read_engine(engine, timeout=600)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = Session(
        source=FSDP2Source(model), transport=opts.transport, rendezvous=rendezvous,
        bucket_bytes=opts.bucket_bytes, transfer_timeout=opts.transfer_timeout, check=opts.check,
    )
    session.connect(engine_ids(opts))
    generator = torch.Generator().manual_seed(0)
    reports = []
    for step in range(opts.updates):
        batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(session.update(f"step-{step + 1}"))
    full = {name: t.clone() for name, t in session.source.gather([s.name for s in session.source.param_specs()]).items()}
    if rank == 0:
        torch.save(full, Path(opts.dump_dir) / "trainer.pt")
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"reports": reports, "buckets": session.bucket_count})
