"""verl's checkpoint-engine backend "p2psync", driven the way verl's CheckpointEngineManager drives it.

Per update, as `CheckpointEngineManager.update_weights` does: `prepare` on every
actor and rollout worker; `build_topology` on the class verl's registry returns;
`init_process_group(**kwargs)` with each worker's share; the actor workers
`send_weights(per-tensor generator, global_steps)` while the rollout worker hands
`receive_weights(global_steps)` to its server adapter, as
`CheckpointEngineWorker.update_weights` does; `finalize` everywhere. The actor is
2 FSDP2 ranks on gloo (the generator gathers with `full_tensor`, as verl's FSDP
engine does); the rollout is a torch engine served by p2psync in the rollout
worker's process. After each update the engine's bytes equal the trainer's (as
DTensor's own `full_tensor` gathers them), bit for bit, and the server adapter was
handed no tensor to load; each trainer rank held only its own rows of verl's stream (torch's
own split) and wrote them with no gather. Environment integrations.
"""

from __future__ import annotations

import asyncio
import queue
import time

import pytest
import torch

from p2psync.worlds.processes import context, process
from tests.helpers.matrix import usable

#: One row of the table: verl's call order over Mooncake, FSDP2 into a torch engine.
pytestmark = pytest.mark.conformance(trainer="fsdp2", engine="torch", transport="mooncake", via="verl")

TRAINERS = 2
UPDATES = 2
JOB = "verl-test"


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 64)
    )


def _bytes(tensor):
    """Raw bytes (tensors through a queue would outlive the process that shares them)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _engine(**kwargs):
    import p2psync.integrations.verl  # noqa: F401  what verl's custom_backend_module does
    from verl.checkpoint_engine import CheckpointEngineRegistry

    return CheckpointEngineRegistry.new("p2psync", bucket_size=4 << 10, **kwargs)


def _topology(engine, role, index, to_parent, mine):
    to_parent.put((role, index, engine.prepare()))
    kwargs = mine.get(timeout=120)
    engine.init_process_group(**kwargs)


def trainer(rank, port, to_parent, mine, results):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2psync.core.rendezvous import Rendezvous

    torch.set_num_threads(1)
    store = Rendezvous(host="127.0.0.1", port=port, job_id=JOB)._root
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=TRAINERS)
    model = build_model(seed=0)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = _engine(is_master=rank == 0, rendezvous=f"127.0.0.1:{port}", job_id=JOB, host_rendezvous=False,
                     transfer_timeout=60, check=True)
    for step in range(1, UPDATES + 1):
        x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _topology(engine, "actor", rank, to_parent, mine)
        per_tensor = ((name, p.detach().full_tensor()) for name, p in model.named_parameters())
        metrics = asyncio.run(engine.send_weights(per_tensor, global_steps=step))
        engine.finalize()
        fulls = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
        rows = sum(t.chunk(TRAINERS)[rank].nbytes for t in fulls.values())  # torch's own split, as the oracle
        if rank == 0:
            results.put(("trainer", step, {name: _bytes(t) for name, t in fulls.items()}, metrics | {"rows": rows}))
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


class ServerAdapter:
    """What verl's server adapter does with receive_weights' stream: load every tensor it yields."""

    def __init__(self, model):
        self.model, self.loaded = model, 0

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors"):
        from verl.workers.rollout.utils import ensure_async_iterator

        params = dict(self.model.named_parameters())
        async for name, tensor in ensure_async_iterator(weights):
            params[name].data.copy_(tensor)
            self.loaded += 1


def rollout(port, to_parent, mine, results):
    from p2psync.adapters.torch import serve
    from p2psync.core.rendezvous import Rendezvous
    from p2psync.integrations.verl import attach

    torch.set_num_threads(1)
    model = build_model(seed=1234)  # other weights than the trainer's
    endpoint = serve(model, engine_id="rollout-0", rendezvous=Rendezvous(host="127.0.0.1", port=port, job_id=JOB),
                     transport="mooncake")
    attach(endpoint)
    engine = _engine(rendezvous=f"127.0.0.1:{port}", job_id=JOB)
    adapter = ServerAdapter(model)
    for step in range(1, UPDATES + 1):
        _topology(engine, "rollout", 0, to_parent, mine)
        asyncio.run(adapter.update_weights(engine.receive_weights(global_steps=step), global_steps=step))
        engine.finalize()
        held = {name: _bytes(p.detach()) for name, p in model.named_parameters()}
        results.put(("rollout", step, held, {"loaded": adapter.loaded, "version": endpoint.version}))
    endpoint.close()


@pytest.fixture(autouse=True)
def _verl_installed() -> None:
    pytest.importorskip("verl", reason="verl is not installed (pip install 'p2psync[verl]'; environment integrations)")
    usable("transports", "mooncake")


def test_verl_registry_has_p2psync_after_import():
    import p2psync.integrations.verl as integration
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get("p2psync")
    assert cls is integration.P2PSyncCheckpointEngine and issubclass(cls, CheckpointEngine)
    actor_kwargs, rollout_kwargs = cls.build_topology(
        2, 3, [{"role": "actor", "rank": 0}, {"role": "actor", "rank": 1}]
        + [{"role": "rollout", "engine_id": e} for e in ("a", "a", "b")]
    )
    update = actor_kwargs["update"][0]
    assert actor_kwargs == {"engines": [["a", "b"], ["a", "b"]], "update": [update] * 2}
    assert rollout_kwargs == {"engine_id": ["a", "a", "b"], "update": [update] * 3}
    again, _ = cls.build_topology(1, 1, [{"role": "actor", "rank": 0}, {"role": "rollout", "engine_id": "a"}])
    assert again["update"] != [update], "each update's topology names it anew"


@pytest.mark.slow
def test_verl_call_order_fsdp2_to_torch_engine_is_bit_exact():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import p2psync.integrations.verl  # noqa: F401
    from p2psync.core.rendezvous import Rendezvous

    ctx = context()
    server = Rendezvous(host="127.0.0.1", port=0, job_id=JOB, is_server=True)
    to_parent, results = ctx.Queue(), ctx.Queue()
    mines = {("actor", r): ctx.Queue() for r in range(TRAINERS)} | {("rollout", 0): ctx.Queue()}
    procs = [process(ctx, trainer, (r, server.port, to_parent, mines["actor", r], results)) for r in range(TRAINERS)]
    procs.append(process(ctx, rollout, (server.port, to_parent, mines["rollout", 0], results)))
    for p in procs:
        p.start()
    got = {}
    try:
        cls = CheckpointEngineRegistry.get("p2psync")
        for step in range(1, UPDATES + 1):
            # verl: metadata = actor workers' prepare() + rollout workers' prepare(), in rank order
            meta = {}
            while len(meta) < TRAINERS + 1:
                role, index, m = _get(to_parent, procs)
                meta[role, index] = m
            ordered = [meta["actor", r] for r in range(TRAINERS)] + [meta["rollout", 0]]
            actor_kwargs, rollout_kwargs = cls.build_topology(TRAINERS, 1, ordered)
            for r in range(TRAINERS):
                mines["actor", r].put({k: v[r] for k, v in actor_kwargs.items()})
            mines["rollout", 0].put({k: v[0] for k, v in rollout_kwargs.items()})
            for _ in range(2):
                role, s, tensors, info = _get(results, procs)
                got[role, s] = (tensors, info)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)

    for step in range(1, UPDATES + 1):
        trained, metrics = got["trainer", step]
        held, info = got["rollout", step]
        assert metrics["p2psync/bytes"] > 0 and metrics["p2psync/phase/finish_seconds"] > 0, metrics
        # each rank kept its own rows of verl's stream (no copy of the model) and wrote them without a gather
        assert metrics["p2psync/stream_held_bytes"] == metrics["rows"], metrics
        assert metrics["p2psync/gathered_bytes"] == 0 and metrics["p2psync/gather_free_bytes"] > 0, metrics
        assert sum(v for k, v in metrics.items() if k.startswith("p2psync/engine/") and k.endswith("/bytes")) == (
            metrics["p2psync/bytes"]), metrics
        assert info == {"loaded": 0, "version": str(step)}  # nothing re-loaded tensor by tensor
        assert held.keys() == trained.keys()
        for name, data in trained.items():
            assert held[name] == data, (step, name)
    assert got["trainer", 1][0]["0.weight"] != got["trainer", 2][0]["0.weight"]


def _get(q, procs):
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(", ".join(f"{p.name} exited with {p.exitcode}" for p in dead)) from None


def test_a_restarted_trainer_without_step_numbers_counts_on_from_what_the_engine_serves():
    """verl may call send_weights without global_steps: the backend labels updates update-N. A
    trainer restarted against an engine that served update-2 goes on at update-3 (the engine
    refuses update-1 for other weights), and the engine holds the new trainer's bytes."""
    usable("engine_targets", "torch")
    from p2psync.adapters.torch import serve
    from p2psync.core.rendezvous import Rendezvous

    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="verl-restart", is_server=True, timeout=30)
    served = build_model(seed=1)
    endpoint = serve(served, engine_id="rollout-0", rendezvous=rendezvous, transport="mooncake")
    try:
        for world, updates in ((0, 2), (1, 1)):  # a trainer, then the one restarted after it
            model = build_model(seed=10 + world)
            engine = _engine(is_master=True, rendezvous=f"127.0.0.1:{rendezvous.port}", job_id="verl-restart",
                             host_rendezvous=False, transfer_timeout=30, check=True)
            engine.init_process_group(engines=["rollout-0"])
            for _ in range(updates):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.25)
                asyncio.run(engine.send_weights(((n, p.detach()) for n, p in model.named_parameters()),
                                                global_steps=None))
            engine.close()
        assert endpoint.version == "update-3"
        for name, p in served.named_parameters():
            assert torch.equal(p.detach(), dict(model.named_parameters())[name].detach()), name
    finally:
        endpoint.close()


def test_a_restarted_rollout_worker_waits_for_this_updates_report_not_an_earlier_ones():
    """verl restarts a rollout worker while the trainer lives on: the new worker knows none of the
    updates before. It waits for the report of the update verl's topology names (each update's own
    token), not for an earlier update's (labelled update-1 alike, without verl's step numbers),
    and returns once the trainer wrote this update, naming its version."""
    usable("engine_targets", "torch")
    from p2psync.adapters.torch import serve
    from p2psync.core.rendezvous import Rendezvous
    from p2psync.integrations.verl import P2PSyncCheckpointEngine

    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="verl-rollout", is_server=True, timeout=30)
    address = f"127.0.0.1:{rendezvous.port}"
    served = build_model(seed=1)
    endpoint = serve(served, engine_id="rollout-0", rendezvous=rendezvous, transport="mooncake")
    model = build_model(seed=2)
    trainer = _engine(is_master=True, rendezvous=address, job_id="verl-rollout", host_rendezvous=False,
                      transfer_timeout=30)

    def rollout_worker():
        return _engine(rendezvous=address, job_id="verl-rollout", engine_id="rollout-0", rendezvous_timeout=30)

    def update(rollout) -> tuple[float, float]:
        """One update as verl's manager runs it; when the rollout side returned and the trainer finished."""
        meta = [trainer.prepare(), rollout.prepare()]
        actor_kwargs, rollout_kwargs = P2PSyncCheckpointEngine.build_topology(1, 1, meta)
        trainer.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
        rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

        async def both() -> tuple[float, float]:
            async def receive() -> float:
                async for _ in rollout.receive_weights(global_steps=None):
                    pass
                return time.monotonic()

            async def send() -> float:
                await asyncio.sleep(1.0)  # the trainer comes later than the rollout side
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.25)
                await trainer.send_weights(((n, p.detach()) for n, p in model.named_parameters()))
                return time.monotonic()

            return tuple(await asyncio.gather(receive(), send()))

        return asyncio.run(both())

    try:
        received, sent = update(rollout_worker())
        assert received >= sent and endpoint.version == "update-1"
        received, sent = update(rollout_worker())  # a new one: restarted
        assert received >= sent, "the restarted rollout worker took an earlier update's report for this one's"
        assert endpoint.version == "update-2"
        for name, p in served.named_parameters():
            assert torch.equal(p.detach(), dict(model.named_parameters())[name].detach()), name
    finally:
        trainer.close()
        endpoint.close()
