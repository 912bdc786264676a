"""p2psync in a Ray job across nodes: 2 FSDP2 trainer actors on one node, rollout replicas as
torch engine actors on others, the job's rendezvous a named Ray actor.

    python docs/examples/ray_two_nodes.py --address HEAD:6379 --trainer-node 0 --engine-nodes 1 2

Run it as a Ray driver (inside the cluster). `--trainer-node N` and `--engine-nodes` pin the
actors with the custom resources `p2psync_node_<N>` the nodes were started with (drop them on a
cluster of your own and place the actors as you do). Every replica runs the same code with the
same job-level environment; its engine id comes from its actor's name (`rollout-{replica}`).
It prints one JSON line: every engine's id, the addresses it published, and whether its bytes
equal the trainer's full state dict after each update (an oracle outside p2psync: SHA-256 of
torch's own tensors on both sides).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import ray
import torch

JOB = "ray-example"
TINY_QWEN3 = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=256,
)


def tiny_model(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_QWEN3))


def sha256(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's bytes, hashed: what the trainer holds against what an engine holds."""
    return {n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in tensors.items()}


@ray.remote(num_cpus=1)
class Trainer:
    """One FSDP2 rank: trains the tiny model and syncs it into the rollout engines."""

    def __init__(self, rank: int, world_size: int, master: str, job: str = JOB, **options: object) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from p2psync import Session
        from p2psync.adapters.fsdp2 import FSDP2Source
        from p2psync.adapters.ray import job_rendezvous

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        self.model = tiny_model(seed=0)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.session = Session(
            source=FSDP2Source(self.model), rendezvous=job_rendezvous(job), transport="mooncake", check=True,
            delta=True, **options,
        )

    def connect(self, engines: list[str]) -> list[str]:
        self.session.connect(engines)
        return sorted(self.session.tables)

    def train_and_sync(self, version: str) -> dict:
        generator = torch.Generator().manual_seed(len(version))
        tokens = torch.randint(0, TINY_QWEN3["vocab_size"], (2, 16), generator=generator)
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        report = self.session.update(version)
        return {
            "ok": report.ok, "engines": {e: r.ok for e, r in report.engines.items()},
            "delta": {e: bool(r.delta_ranks) for e, r in report.engines.items()}, "report": report.format(),
        }

    def full_state(self) -> dict[str, str]:
        """The whole model as torch's own full state dict gathers it (every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return sha256(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True)))


@ray.remote(num_cpus=1)
class Rollout:
    """One rollout replica: a torch engine serving the tiny model until p2psync updates it."""

    def __init__(self, job: str = JOB) -> None:
        from p2psync.adapters.ray import job_rendezvous
        from p2psync.adapters.torch import serve

        torch.set_num_threads(1)
        self.model = tiny_model(seed=1)
        self.endpoint = serve(
            self.model, engine_id="rollout-{replica}", rendezvous=job_rendezvous(job, patient=True),
            transport="mooncake",
        )

    def describe(self) -> dict:
        table = self.endpoint.table
        assert table is not None
        return {
            "engine_id": self.endpoint.engine_id, "node": ray.util.get_node_ip_address(),
            "control_url": table.control_url, "transport": table.transport_info, "version": self.endpoint.version,
        }

    def state(self) -> dict[str, str]:
        return sha256(self.model.state_dict())


def pinned(node: int | None) -> dict:
    return {"resources": {f"p2psync_node_{node}": 1}} if node is not None else {}


@ray.remote(num_cpus=0)
def node_address() -> str:
    return ray.util.get_node_ip_address()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto", help="the Ray cluster to join")
    parser.add_argument("--trainer-node", type=int, default=None)
    parser.add_argument("--engine-nodes", type=int, nargs="+", default=[None, None])
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--job", default=JOB, help="the job id (one rendezvous actor per job)")
    args = parser.parse_args()
    # Job-level settings reach every actor alike (so an engine id cannot come from one of them).
    ray.init(address=args.address, runtime_env={"env_vars": {"P2PSYNC_LOG": os.environ.get("P2PSYNC_LOG", "INFO")}})

    rollouts = [
        Rollout.options(name=f"rollout_{i}", **pinned(node)).remote(args.job) for i, node in enumerate(args.engine_nodes)
    ]
    engines = [ray.get(r.describe.remote()) for r in rollouts]
    master = f"{ray.get(node_address.options(**pinned(args.trainer_node)).remote())}:29511"
    trainers = [Trainer.options(**pinned(args.trainer_node)).remote(rank, 2, master, args.job) for rank in range(2)]
    ids = [e["engine_id"] for e in engines]
    ray.get([t.connect.remote(ids) for t in trainers])

    updates = []
    for step in range(1, args.updates + 1):
        reports = ray.get([t.train_and_sync.remote(f"step-{step}") for t in trainers])
        full = ray.get([t.full_state.remote() for t in trainers])[0]  # a collective: every rank takes part
        held = ray.get([r.state.remote() for r in rollouts])
        updates.append({"reports": reports, "equal": {e: h == full for e, h in zip(ids, held)}})
    print(json.dumps({"engines": engines, "updates": updates}))


if __name__ == "__main__":
    main()
