"""`p2psync demo`: FSDP2 trainer ranks updating torch engines over a transport, on one machine.

Each engine is its own process holding a transformers model; each trainer rank
is a process in a gloo world training the same architecture with FSDP2. After
every training step the trainer syncs its weights into the engines, verifies
them by digest, and checks that a greedy generation on each engine equals the
trainer's own. The same pieces drive the end-to-end tests.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from .core.endpoint import EngineEndpoint
    from .core.rendezvous import Rendezvous

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
PROMPT = [1, 17, 42, 99, 7, 3]


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
    bucket_bytes: int = 64 << 20
    transfer_timeout: float = 60.0
    check: bool = True
    progress: bool = True
    #: Where engines and trainer rank 0 save their final weights (for tests), or None.
    dump_dir: str | None = None
    job_id: str = field(default_factory=lambda: f"demo-{os.getpid()}-{int(time.time())}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(size: str, seed: int) -> Any:
    """A randomly initialized Qwen3 causal LM (no download)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**CONFIGS[size], max_position_embeddings=256, initializer_range=0.05)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def greedy(model: Any, tokens: int = 8) -> list[int]:
    """Greedy continuation of the fixed prompt."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=next(model.parameters()).device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(PROMPT):].tolist()


def engine_ids(opts: DemoOptions) -> list[str]:
    """The ids of the demo's engines (engine process `i` serves `engine-{i}`)."""
    return [f"engine-{i}" for i in range(opts.engines)]


def start_engine(index: int, opts: DemoOptions, port: int) -> tuple[Any, EngineEndpoint]:
    """Build engine `index`'s model in this process and serve it (with a `generate` route);
    return the model and its endpoint."""
    import torch

    from .adapters.torch import serve
    from .core.devices import resolve
    from .core.endpoint import EngineHooks
    from .core.logs import configure
    from .core.rendezvous import Rendezvous

    engine_id = f"engine-{index}"
    configure(f"{engine_id} rank 0")
    torch.set_num_threads(1)
    model = build_model(opts.size, seed=1000 + index).to(resolve(opts.device).device)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    hooks = EngineHooks(routes={"generate": lambda body: {"tokens": greedy(model, int(body.get("tokens", 8)))}})
    return model, serve(model, engine_id=engine_id, rendezvous=rendezvous, transport=opts.transport, hooks=hooks)


def engine_main(index: int, opts: DemoOptions, port: int, stop: Any) -> None:
    """One torch engine: a model in its own process, served until `stop` is set."""
    import torch

    model, endpoint = start_engine(index, opts, port)
    engine_id = endpoint.engine_id
    stop.wait()
    if opts.dump_dir:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(opts.dump_dir) / f"{engine_id}.pt")
    endpoint.close()


def join_trainer_world(rank: int, opts: DemoOptions, port: int) -> Rendezvous:
    """Join the trainer world (gloo on CPU, NCCL on CUDA) as `rank`, through the launcher's
    rendezvous store (no second port); return the rendezvous."""
    import torch
    import torch.distributed as dist

    from .core.devices import resolve
    from .core.logs import configure
    from .core.rendezvous import Rendezvous

    configure(f"trainer {rank}")
    torch.set_num_threads(1)
    placement = resolve(opts.device)
    if placement.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    dist.init_process_group(
        placement.collective_backend, store=dist.PrefixStore(f"gloo/{opts.job_id}", rendezvous._root),
        rank=rank, world_size=opts.trainers,
    )
    return rendezvous


def start_trainer(rank: int, opts: DemoOptions, port: int) -> tuple[Rendezvous, Any]:
    """Join the trainer world as `rank`; return the rendezvous and the FSDP2-sharded model."""
    from torch.distributed.fsdp import fully_shard

    from .core.devices import resolve

    rendezvous = join_trainer_world(rank, opts, port)
    model = build_model(opts.size, seed=0).to(resolve(opts.device).device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return rendezvous, model


def trainer_main(rank: int, opts: DemoOptions, port: int, results: Any) -> None:
    """One FSDP2 trainer rank: train a step, sync, verify, repeat."""
    import torch
    import torch.distributed as dist

    from .adapters.fsdp2 import FSDP2Source
    from .core.control import post
    from .core.devices import resolve
    from .core.session import Session

    rendezvous, model = start_trainer(rank, opts, port)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engines = engine_ids(opts)
    session = Session(
        source=FSDP2Source(model), transport=opts.transport, rendezvous=rendezvous,
        bucket_bytes=opts.bucket_bytes, transfer_timeout=opts.transfer_timeout, check=opts.check,
        pin_memory=resolve(opts.device).pin_buffers,
    )
    session.connect(engines)
    generator = torch.Generator().manual_seed(rank)
    reports, generations = [], []
    bar = None
    if rank == 0 and opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=opts.updates * session.bucket_count, desc="syncing", unit="bucket")
    for step in range(opts.updates):
        model.train()
        batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator).to(resolve(opts.device).device)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        report = session.update(f"step-{step + 1}", progress=(lambda done, total: bar.update(1)) if bar else None)
        expected = greedy(model)  # collective under FSDP2: every rank runs it
        if rank == 0:
            got = {}
            for table in session.tables.values():
                if report.engines[table[0].engine_id].ok:
                    got[table[0].engine_id] = post(table[0].control_url, "generate", {}, token=session.token, timeout=120)["tokens"]
            reports.append(report)
            generations.append({"trainer": expected, **got})
    if bar:
        bar.close()
    full = {name: t.clone() for name, t in session.source.gather([s.name for s in session.source.param_specs()]).items()}
    if rank == 0 and opts.dump_dir:
        torch.save(full, Path(opts.dump_dir) / "trainer.pt")
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"reports": reports, "generations": generations})


def run(opts: DemoOptions) -> dict[str, Any]:
    """Start engines and trainers, run the updates, stop everything; return rank 0's results.

    Raises RuntimeError if any process failed.
    """
    return launch(opts, engine_main, trainer_main)


def launch(
    opts: DemoOptions, engine: Callable[..., None], trainer: Callable[..., None], engine_processes: int | None = None
) -> Any:
    """Host the rendezvous, start `engine(index, opts, port, stop)` (`engine_processes` of them,
    default `opts.engines`) and `trainer(rank, opts, port, results)` processes, return what
    trainer rank 0 puts in `results`, stop everything.

    Raises RuntimeError if any process failed.
    """
    from .core.rendezvous import Rendezvous

    ctx = mp.get_context("spawn")
    server = Rendezvous(host="127.0.0.1", port=0, job_id=opts.job_id, is_server=True)
    port = server.port
    stop = ctx.Event()
    results = ctx.Queue()
    count = opts.engines if engine_processes is None else engine_processes
    engines = [ctx.Process(target=engine, args=(i, opts, port, stop), name=f"engine-{i}") for i in range(count)]
    trainers = [ctx.Process(target=trainer, args=(r, opts, port, results), name=f"trainer-{r}") for r in range(opts.trainers)]
    for p in engines + trainers:
        p.start()
    try:
        outcome = _wait_for_result(results, trainers + engines)  # a dead engine fails the run now, not at a timeout
    finally:
        stop.set()
        for p in engines + trainers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [f"{p.name} exited with {p.exitcode}" for p in engines + trainers if p.exitcode != 0]
    if failed:
        raise RuntimeError("processes failed: " + ", ".join(failed))
    return outcome


def _wait_for_result(results: Any, processes: list[Any]) -> Any:
    import queue

    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(", ".join(f"{p.name} exited with {p.exitcode}" for p in dead)) from None
