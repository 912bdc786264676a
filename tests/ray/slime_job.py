"""A Ray driver for the emulated nodes (run inside node 0): slime's and miles' updaters as their
trainer actors call them, with real Ray actor handles. Prints one JSON line for the test to read.

Stand-ins written after the frameworks' code (neither is on the package registry):
- `TrainActor`, after slime's `MegatronTrainRayActor` (slime/backends/megatron_utils/actor.py):
  it builds its updater once, `UpdateWeightFromP2PSync(args, model, weights_getter=...,
  model_name=..., quantization_config=...)` (miles' actor: `P2PSyncWeightUpdater(...)`), and per
  `update_weights(rollout_engines, rollout_engine_lock, num_new_engines)` connects when engines
  are new, passes a barrier, updates, then (its ci_test) asks an engine through its actor handle
  for the weight version and compares it with the updater's. FSDP2 here (Megatron's actor works
  the same calls; the matrix runs the Megatron source through them).
- `RolloutEngine`, after slime's `SGLangEngine` actor: a torch engine served under
  `rollout-{replica}` (its actor's name), with `get_weight_version`.
- `Lock`, after slime's lock actor (ray/utils.py): acquire/release.
Every setting reaches the actors as the job's environment (no p2psync code in the driver but
the updater's import): P2PSYNC_RENDEZVOUS=ray, P2PSYNC_SOURCE, P2PSYNC_JOB_ID, P2PSYNC_CHECK.

The run: two engines on nodes 1 and 2; slime's updater in 2 trainer actors on node 0 takes two
steps; the trainer actors are killed (as a crash ends them) and miles' updater in new ones
connects to the same handles and takes one. After each, every engine's bytes against torch's
full state dict (SHA-256, outside p2psync).
"""

from __future__ import annotations

import argparse
import json
import os
from argparse import Namespace

import ray

from tests.ray.scenario import CALL, load_example

ex = load_example()


@ray.remote(num_cpus=0)
class Lock:
    """slime's rollout engine lock: the updater it is handed to needs none (nothing is broadcast)."""

    def __init__(self) -> None:
        self.held = False

    def acquire(self) -> bool:
        if self.held:
            return False
        self.held = True
        return True

    def release(self) -> None:
        self.held = False


@ray.remote(num_cpus=1)
class RolloutEngine:
    """slime's SGLangEngine actor, the engine a torch one: serves until p2psync updates it."""

    def __init__(self) -> None:
        import torch

        from p2psync.adapters.ray import rendezvous_at
        from p2psync.adapters.torch import serve

        torch.set_num_threads(1)
        self.model = ex.tiny_model(seed=1)
        rendezvous = rendezvous_at("ray", job_id=os.environ["P2PSYNC_JOB_ID"], patient=True)
        self.endpoint = serve(self.model, engine_id="rollout-{replica}", rendezvous=rendezvous, transport="mooncake")

    def get_weight_version(self) -> str | None:
        return self.endpoint.version

    def state(self) -> dict[str, str]:
        return ex.sha256(self.model.state_dict())


@ray.remote(num_cpus=1)
class TrainActor:
    """One trainer rank of slime's (or miles') Megatron actor, FSDP2 here."""

    def __init__(self, rank: int, world_size: int, master: str, updater: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from p2psync.integrations.miles import P2PSyncWeightUpdater, UpdateWeightFromP2PSync

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        self.model = ex.tiny_model(seed=0)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        args = Namespace(update_weight_buffer_size=1 << 20, vocab_size=ex.TINY_QWEN3["vocab_size"])
        if updater == "slime":
            self.weight_updater = UpdateWeightFromP2PSync(
                args, [self.model], weights_getter=dict, model_name="qwen3config", quantization_config=None
            )
        else:
            self.weight_updater = P2PSyncWeightUpdater(
                args, [self.model], weights_getter=dict, model_name="qwen3config", quantization_config=None,
                iterator_factory=None, parallel_state=None, is_lora=False,
            )

    def train(self, step: int) -> None:
        import torch

        tokens = torch.randint(0, ex.TINY_QWEN3["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def update_weights(self, rollout_engines: list, rollout_engine_lock, num_new_engines: int) -> dict:
        """The actor's update_weights, in its order; the versions its ci_test compares (it asks one
        engine at random, this asks each)."""
        import torch.distributed as dist

        counts = [1] * len(rollout_engines)
        offsets = list(range(len(rollout_engines)))
        if num_new_engines > 0:
            if rollout_engine_lock is None:  # miles' WeightUpdater takes no lock
                self.weight_updater.connect_rollout_engines(rollout_engines, engine_gpu_counts=counts,
                                                            engine_gpu_offsets=offsets)
            else:
                self.weight_updater.connect_rollout_engines(rollout_engines, rollout_engine_lock,
                                                            engine_gpu_counts=counts, engine_gpu_offsets=offsets)
            dist.barrier()
        self.weight_updater.update_weights()
        return {"updater": str(self.weight_updater.weight_version),
                "engines": ray.get([e.get_weight_version.remote() for e in rollout_engines], timeout=CALL)}

    def full_state(self) -> dict[str, str]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return ex.sha256(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    settings = {"P2PSYNC_RENDEZVOUS": "ray", "P2PSYNC_SOURCE": "fsdp2", "P2PSYNC_JOB_ID": args.job,
                "P2PSYNC_CHECK": "1"}
    ray.init(address=args.address, runtime_env={"env_vars": settings})
    engines = [RolloutEngine.options(name=f"rollout_{i}", **ex.pinned(node)).remote() for i, node in ((0, 1), (1, 2))]
    ray.get([e.get_weight_version.remote() for e in engines], timeout=CALL)  # up, as slime waits for its engines
    lock = Lock.remote()

    def world(updater: str, port: int) -> list:
        master = f"{ray.get(ex.node_address.options(**ex.pinned(0)).remote())}:{port}"
        return [TrainActor.options(**ex.pinned(0)).remote(rank, 2, master, updater) for rank in range(2)]

    def step(actors: list, number: int, new: int, engine_lock) -> dict:
        ray.get([a.train.remote(number) for a in actors], timeout=CALL)
        versions = ray.get([a.update_weights.remote(engines, engine_lock, new) for a in actors], timeout=CALL)
        full = ray.get([a.full_state.remote() for a in actors], timeout=CALL)[0]
        return {"versions": versions, "equal": [ray.get(e.state.remote(), timeout=CALL) == full for e in engines]}

    out: dict = {}
    slime = world("slime", 29531)
    out["slime"] = [step(slime, 1, len(engines), lock), step(slime, 2, 0, lock)]
    for actor in slime:  # the trainer world ends as a crash ends it
        ray.kill(actor)
    miles = world("miles", 29532)
    out["miles"] = [step(miles, 3, len(engines), None)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
