"""Trainer worlds: one kind of trainer per world, every run (transport) of that kind against the
world's engines, one after another.

Each trainer kind holds the world's model and says what it must have sent, without the
code under test: FSDP2's full state dict from torch's own `get_model_state_dict`; for
Megatron (and Megatron-Bridge), a transformers model trained in one process, whose tensors
every rank loads into its Megatron shards after each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from .engines import dump_path, engine_ids, harness_key
from .launch import Part, join_trainer_world
from .models import Trainer, greedy
from .options import DeltaMemory, RunResult, split_kind
from .options import trainer_kind as trainer_kind  # where the conformance suite imports it from

if TYPE_CHECKING:
    import torch

    from ..core.rendezvous import Rendezvous
    from ..core.report import UpdateReport
    from ..core.source import TrainerSource
    from ..trainer.session import Session
    from .options import WorldOptions


@dataclass
class TrainerRank:
    """One trainer rank: its framework model and source, a training step, the full HF tensors
    it holds by an independent path (on rank 0; collective), and its greedy continuation
    (collective)."""

    rank: int
    rendezvous: Rendezvous
    model: Any
    source: TrainerSource
    step: Callable[[], None]
    oracle: Callable[[], dict[str, torch.Tensor] | None]
    greedy: Callable[[], list[int]]
    #: Why the model does not hold the oracle's weights in meaning, or "" (collective).
    verify: Callable[[], str] = lambda: ""


def start_fsdp2(rank: int, opts: WorldOptions, port: int) -> tuple[Rendezvous, Any]:
    """Join the trainer world as `rank`; return the rendezvous and the world's model (seed 0)
    sharded with FSDP2 per decoder layer and at the root."""
    from torch.distributed.fsdp import fully_shard

    from ..core.devices import resolve

    rendezvous = join_trainer_world(rank, opts, port, world_size=opts.ranks_of("fsdp2"), timeout=opts.startup_timeout)
    model = opts.model.build(seed=0).to(resolve(opts.device).device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return rendezvous, model


def fsdp2_trainer(rank: int, opts: WorldOptions, port: int) -> TrainerRank:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..adapters.fsdp2 import FSDP2Source

    rendezvous, model = start_fsdp2(rank, opts, port)
    trainer = Trainer(model, seed=rank)

    def oracle() -> dict[str, torch.Tensor] | None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # full_state_dict: plain tensors (no DTensor or ShardedTensor among its values)
        return cast("dict[str, torch.Tensor]", dict(full)) if rank == 0 else None

    return TrainerRank(rank, rendezvous, model, FSDP2Source(model), trainer.step, oracle, lambda: greedy(model))


def megatron_trainer(rank: int, opts: WorldOptions, port: int, *, bridge: bool = False) -> TrainerRank:
    """Megatron-Core TP over the world (Megatron-Bridge: TP 2 x PP world/2) whose weights are
    those of a transformers model that every rank trains alike in its own process. The
    source is p2psync's name table (`megatron`) or Bridge's own mappings (`megatron-bridge`).
    `load_hf` places the weights by the inverse of p2psync's name table: without pipeline
    parallelism the run also checks that Megatron then computes the reference's logits, so a
    table wrong both ways cannot pass."""
    import torch.distributed as dist

    from .megatron import Case, load_hf, logits_differ, megatron_model

    reference = opts.model.build(seed=0)
    kind = "megatron-bridge" if bridge else "megatron"
    rendezvous = join_trainer_world(rank, opts, port, world_size=opts.ranks_of(kind), timeout=opts.startup_timeout)
    ranks, arch = dist.get_world_size(), opts.model.arch
    case = Case(arch, tp=2, pp=ranks // 2) if bridge else Case(arch, tp=ranks)
    model = megatron_model(case, opts.model.config_dict())
    if bridge:
        from ..adapters.megatron.bridge import BridgeSource
        from .megatron import bridge_deepseek_registry

        source: TrainerSource = BridgeSource(model, bridge_deepseek_registry())  # after the parallel state
    else:
        from ..adapters.megatron import MegatronSource

        source = MegatronSource(model, arch)
    trainer = Trainer(reference, seed=0)  # the same batches on every rank: the reference stays equal everywhere

    def tensors() -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in reference.state_dict().items()}

    def step() -> None:
        trainer.step()
        load_hf(model, tensors(), arch)

    load_hf(model, tensors(), arch)
    return TrainerRank(
        rank, rendezvous, model, source, step, lambda: tensors() if rank == 0 else None, lambda: greedy(reference),
        (lambda: "") if case.pp > 1 else (lambda: logits_differ(model, reference)),
    )


TRAINERS: dict[str, Callable[[int, Any, int], TrainerRank]] = {
    "fsdp2": fsdp2_trainer,
    "megatron": megatron_trainer,
    "megatron-bridge": lambda rank, opts, port: megatron_trainer(rank, opts, port, bridge=True),
}


class Connection(Protocol):
    bucket_count: int
    gather_free_bytes: tuple[int, int]

    @property
    def session(self) -> Session: ...

    def update(self, version: str) -> UpdateReport: ...

    def close(self) -> None: ...


def harness_urls(trainer: TrainerRank, opts: WorldOptions) -> dict[str, list[str]]:
    """Every engine rank's harness URL, per engine (waits for the engines to start)."""
    return {
        e: [trainer.rendezvous.get(harness_key(e, r), timeout=opts.startup_timeout).decode()
            for r in range(opts.engine_tp)]
        for e in engine_ids(opts)
    }


def _post_all(urls: dict[str, list[str]], route: str, body: dict[str, Any], token: str) -> None:
    from ..core.control import post

    for engine_urls in urls.values():
        for url in engine_urls:
            post(url, route, body, token=token, timeout=300)


class SessionConnection:
    """Engines served by p2psync endpoints (torch, sglang): rank 0 has them serve `transport`,
    then every rank connects one Session."""

    def __init__(
        self, trainer: TrainerRank, opts: WorldOptions, transport: str, urls: dict[str, list[str]], way: str
    ) -> None:
        from ..core.devices import resolve
        from ..trainer.session import Session

        token = trainer.rendezvous.token()
        if trainer.rank == 0:
            _post_all(urls, "serve", {"transport": transport}, token)
        self.session = Session(
            source=trainer.source, transport=transport, rendezvous=trainer.rendezvous,
            options=opts.session_for(way, pin_memory=resolve(opts.device).pin_buffers),
        )
        self.session.connect(engine_ids(opts), progress=_connect_bar() if trainer.rank == 0 and opts.progress else None)
        self.bucket_count = self.session.stats().bucket_count
        self.gather_free_bytes = self.session.stats().gather_free_bytes
        self.bar = None
        if trainer.rank == 0 and opts.progress:
            from tqdm import tqdm

            # In bytes rank 0 produces (its total known at the first update's first step); quiet off a terminal
            self.bar = tqdm(desc="syncing", unit="B", unit_scale=True, unit_divisor=1024, disable=None)
        self.updates = opts.updates

    def update(self, version: str) -> UpdateReport:
        bar = self.bar
        if bar is None:
            return self.session.update(version)
        start = bar.n

        def step(done: int, total: int) -> None:
            if bar.total is None:
                bar.total = total * self.updates
            bar.update(start + done - bar.n)

        return self.session.update(version, progress=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.session.close()


class WorkerClient:
    """vLLM's `VLLMWeightSyncClient` for one engine: each call goes to every rank's worker, as
    vLLM's engine core fans a call out to its workers."""

    def __init__(self, urls: list[str], token: str) -> None:
        self.urls, self.token = urls, token

    def _all(self, route: str, body: dict[str, Any] | None = None) -> None:
        _post_all({"": self.urls}, route, body or {}, self.token)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", {"weight_version": weight_version})


class VllmConnection:
    """vLLM engines, driven through vLLM's trainer-side weight-transfer factory with the
    `p2psync` backend, one client per engine: its init call has the workers serve `transport`."""

    def __init__(
        self, trainer: TrainerRank, opts: WorldOptions, transport: str, urls: dict[str, list[str]], way: str
    ) -> None:
        from ..adapters.vllm import shim


        shim.import_vllm()  # before any vLLM module: it selects the CPU platform
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from ..adapters.vllm import vllm_plugin
        from ..adapters.vllm.transfer import EngineClients, P2PSyncTrainerInitInfo

        token = trainer.rendezvous.token()
        if trainer.rank == 0:
            _post_all(urls, "reset", {}, token)  # the last run's endpoints
        clients = EngineClients({e: WorkerClient(u, token) for e, u in urls.items()})
        vllm_plugin.register()
        init = P2PSyncTrainerInitInfo(
            rank=trainer.rank, engine_ids=list(urls), rendezvous_host="127.0.0.1",
            rendezvous_port=trainer.rendezvous.port, job_id=opts.job_id, transport=transport,
            options=opts.session_for(way),
        )
        self.sync = WeightTransferTrainerFactory.trainer_init(init, client=clients, source=trainer.source)
        self.bucket_count = self.sync.session.stats().bucket_count
        self.gather_free_bytes = self.sync.session.stats().gather_free_bytes

    @property
    def session(self) -> Session:
        return self.sync.session

    def update(self, version: str) -> UpdateReport:
        self.sync.send_weights(version)
        assert self.sync.report is not None
        return self.sync.report

    def close(self) -> None:
        self.sync.shutdown()


def connect(
    trainer: TrainerRank, opts: WorldOptions, transport: str, urls: dict[str, list[str]], way: str
) -> Connection:
    if opts.engine == "vllm":
        return VllmConnection(trainer, opts, transport, urls, way)
    return SessionConnection(trainer, opts, transport, urls, way)


def dump(trainer: TrainerRank, opts: WorldOptions, urls: dict[str, list[str]], folder: Path) -> Path:
    """Save what the trainer holds by its independent path (`oracle.pt`) and have every engine
    rank save what it holds, into `folder` (collective: the oracle may gather)."""
    import torch

    from ..core.control import post

    oracle = trainer.oracle()
    if trainer.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(oracle, folder / "oracle.pt")
        for e, engine_urls in urls.items():
            for r, url in enumerate(engine_urls):
                post(url, "dump", {"path": str(dump_path(folder, e, r))}, token=trainer.rendezvous.token(), timeout=300)
    return folder


def delta_memory(session: Session) -> DeltaMemory:
    """What `session` holds for delta updates on this rank, and what bounds it."""
    stats = session.stats()
    params = sum(len(t.params) for tables in session.tables.values() for t in tables)
    return DeltaMemory(stats.baseline_bytes, stats.patch_buffer_bytes, sum(stats.gather_free_bytes), params)


def version_label(kind: str, transport: str, update: int) -> str:
    """The label of a run's `update`-th update: each run's its own, since the world's engines
    refuse a label an earlier run served (for other weights)."""
    return f"{kind}-{transport}-{update}"


def trainer_main(rank: int, opts: WorldOptions, port: int, results: Any, kind: str) -> None:
    """A rank of the `kind` trainer world: each of its runs in turn; rank 0 reports each run."""
    import torch.distributed as dist

    from ..core.control import post

    source_kind, way = split_kind(kind)
    trainer = TRAINERS[source_kind](rank, opts, port)
    urls = harness_urls(trainer, opts) if rank == 0 else {}
    token = trainer.rendezvous.token()
    for transport in opts.transports_of(kind):
        connection = connect(trainer, opts, transport, urls, way)
        reports, generations = [], []
        for i in range(opts.updates):
            trainer.step()
            reports.append(connection.update(version_label(kind, transport, i + 1)))
            if opts.generate:
                expected = trainer.greedy()
                if rank == 0:
                    generations.append({"trainer": expected} | {
                        e: post(u[0], "generate", {}, token=token, timeout=120)["tokens"]
                        for e, u in urls.items() if reports[-1].engines[e].ok
                    })
        memory = delta_memory(connection.session)
        folder = dump(trainer, opts, urls, Path(opts.dump_dir) / kind / transport) if opts.dump_dir else None
        meaning = trainer.verify()
        connection.close()
        dist.barrier()
        if rank == 0:
            results.put(Part(RunResult(
                kind, transport, reports, generations, connection.bucket_count, connection.gather_free_bytes,
                str(folder or ""), meaning=meaning, delta_memory=memory,
            )))
    dist.barrier()  # every rank is done before any tears down
    dist.destroy_process_group()
    if rank == 0:
        results.put("done")


def _connect_bar() -> Callable[[int, int], None]:
    """A bar of the connect's layouts (quiet off a terminal), closed once the last is at hand."""
    from tqdm import tqdm

    bar = tqdm(desc="connecting", unit="layout", disable=None)

    def told(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return told
