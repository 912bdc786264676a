"""Processes of the vLLM end-to-end test, started through `p2psync.demo.launch`.

Engine rank processes: each builds vLLM's model of its TP rank on CPU, creates the
"p2psync" weight-transfer engine through vLLM's factory (registered by the plugin
function) and serves vLLM's four worker calls over HTTP, as a vLLM worker's RPCs
would reach it. Trainer processes: FSDP2 over a transformers model of the same
config, or Megatron-Core holding that model's weights, driving vLLM's trainer-side
factory with one client per engine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2psync.demo import DemoOptions

KIND = "qwen3"
ROUTES = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


@dataclass
class VllmE2EOptions(DemoOptions):
    """`engines` counts engine rank processes: engine `i // tp`, rank `i % tp`."""

    tp: int = 2
    dtype: str = "bfloat16"
    #: How long trainers wait for engine ranks to come up (vLLM imports slowly on a busy machine).
    startup_timeout: float = 600.0


def engine_config(opts: VllmE2EOptions) -> Any:
    from vllm_helpers import hf_config_dict

    from p2psync.adapters.vllm import shim

    return shim.engine_config(hf_config_dict(KIND), tp=opts.tp, dtype=opts.dtype)


def engine_rank_main(index: int, opts: VllmE2EOptions, port: int, stop: Any) -> None:
    from p2psync.adapters.vllm import shim

    shim.import_vllm()  # before any vLLM module: it selects the CPU platform
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm_helpers import hf_model, vllm_loaded

    from p2psync.adapters.vllm import vllm_plugin
    from p2psync.core.control import ControlServer
    from p2psync.core.logs import configure
    from p2psync.core.rendezvous import Rendezvous

    engine_id, rank = f"engine-{index // opts.tp}", index % opts.tp
    configure(f"{engine_id} rank {rank}")
    torch.set_num_threads(1)
    config = engine_config(opts)
    with shim.rank_state(config, rank):  # the parallel state a vLLM worker of this rank has
        model = vllm_loaded(config, rank, hf_model(KIND, seed=1000 + index // opts.tp).state_dict())

        vllm_plugin.register()
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="p2psync"), config, torch.device("cpu"), model
        )
        calls: list[list[Any]] = []

        def route(name: str) -> Any:
            def call(body: dict[str, Any]) -> dict[str, Any]:
                calls.append([name, body])
                if name == "init_weight_transfer_engine":
                    engine.init_transfer_engine(engine.parse_init_info(body["init_info"]))
                elif name == "update_weights":
                    engine.update_weights(body["update_info"])
                else:
                    getattr(engine, name)()
                return {}

            return call

        server = ControlServer({name: route(name) for name in ROUTES})
        Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id).set(f"worker/{engine_id}/{rank}", server.url)
        stop.wait()
        server.close()
        held = {name: p.data.clone() for name, p in model.named_parameters()}
        torch.save({"params": held, "calls": calls}, Path(opts.dump_dir) / f"{engine_id}-rank{rank}.pt")
        engine.shutdown()
    # Everything is saved and closed. Interpreter teardown of a process holding vLLM and Mooncake
    # hangs in native code (seen: >30 s, no Python frame), so end the process here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerClient:
    """vLLM's `VLLMWeightSyncClient` for one engine: each call goes to every rank's worker,
    as vLLM's engine core fans a call out to its workers."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def _all(self, route: str, body: dict[str, Any] | None = None) -> None:
        from p2psync.core.control import post

        for url in self.urls:
            post(url, route, body, timeout=120)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", {"weight_version": weight_version})


def join_world(rank: int, opts: VllmE2EOptions, port: int) -> Any:
    """Join the trainer world through the launcher's store; return this rank's rendezvous (which
    waits `opts.startup_timeout` for the engine ranks' workers)."""
    import torch.distributed as dist

    from p2psync.core.logs import configure
    from p2psync.core.rendezvous import Rendezvous

    configure(f"trainer {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id, timeout=opts.startup_timeout)
    store = dist.PrefixStore(f"gloo/{opts.job_id}", rendezvous._root)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=opts.trainers)
    return rendezvous


def trainer_main(rank: int, opts: VllmE2EOptions, port: int, results: Any) -> None:
    """An FSDP2 trainer rank over the engines' model, one AdamW step per update."""
    from p2psync.adapters.vllm import shim

    shim.import_vllm()  # before any vLLM module: it selects the CPU platform
    from torch.distributed.fsdp import fully_shard
    from vllm_helpers import hf_model

    from p2psync.adapters.fsdp2 import FSDP2Source

    rendezvous = join_world(rank, opts, port)
    model = hf_model(KIND, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)

    def step(_: int) -> None:
        batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    send(rank, opts, port, rendezvous, FSDP2Source(model), step, results)


def megatron_trainer_main(rank: int, opts: VllmE2EOptions, port: int, results: Any) -> None:
    """A Megatron-Core trainer rank (TP = `opts.trainers`) holding the engines' model."""
    from p2psync.adapters.vllm import shim

    shim.import_vllm()  # before any vLLM module: it selects the CPU platform
    from megatron_harness import megatron_trainer
    from vllm_helpers import hf_model

    rendezvous, source, step = megatron_trainer(hf_model(KIND, seed=0), KIND, lambda: join_world(rank, opts, port))
    send(rank, opts, port, rendezvous, source, step, results)


def send(
    rank: int, opts: VllmE2EOptions, port: int, rendezvous: Any, source: Any, step: Callable[[int], None], results: Any
) -> None:
    """Drive vLLM's trainer-side weight-transfer flow, one client per engine: `step`, then send,
    `opts.updates` times; rank 0 saves the final HF tensors and reports."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from p2psync.adapters.vllm import vllm_plugin
    from p2psync.adapters.vllm.transfer import EngineClients, P2PSyncTrainerInitInfo

    engine_ids = [f"engine-{i}" for i in range(opts.engines // opts.tp)]
    clients = EngineClients(
        {e: WorkerClient([rendezvous.get(f"worker/{e}/{r}").decode() for r in range(opts.tp)]) for e in engine_ids}
    )
    vllm_plugin.register()
    init = P2PSyncTrainerInitInfo(
        rank=rank, engine_ids=engine_ids, rendezvous_host="127.0.0.1", rendezvous_port=port, job_id=opts.job_id,
        transport=opts.transport, bucket_bytes=opts.bucket_bytes, transfer_timeout=opts.transfer_timeout,
        check=opts.check,
    )
    sync = WeightTransferTrainerFactory.trainer_init(init, client=clients, source=source)
    reports = []
    for i in range(opts.updates):
        step(i)
        sync.send_weights(f"step-{i + 1}")
        reports.append(sync.report)
    full = {name: t.clone() for name, t in source.gather([s.name for s in source.param_specs()]).items()}
    if rank == 0:
        torch.save(full, Path(opts.dump_dir) / "trainer.pt")
    sync.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"reports": reports})
