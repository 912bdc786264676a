"""verl 0.9.1's CheckpointEngineManager over 2 real SGLangReplica servers (sglang 0.5.23, CPU) and the stand-in trainer.

    python -m tests.verl_ray.scenario OUT_DIR --address HEAD   (a driver on node 0 of the emulated Ray cluster
                                                               test_verl_manager.py makes: 1 logical GPU per node)

The trainer's worker group is pinned to node 0 (verl's own `accelerator_type`: a bundle's custom resource), so the
replicas' pools take the GPUs of nodes 1 and 2. Writes OUT_DIR/result.json: where each ran, and per update verl's
metrics (the trainer's report per engine among them), each replica's greedy tokens and extra_fields. The servers
carry p2psync's sglang plugin (P2PSYNC_SGLANG_ENDPOINT, engine ids rollout-{replica}, rendezvous "ray", no
server_url: verl pauses them); the backend is p2psync.integrations.verl. Nothing sets an address: each process
finds its node's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

NREPLICAS = 2
STEPS = (None, 1, 2)  # verl's global_steps per update: the first update runs before training, with none
PROMPTS = ([5, 6, 7], [40, 41, 42, 43, 44])
NEW_TOKENS = 8
JOB = "verl"


def build_config(model_dir: str):
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        config = compose(config_name="ppo_trainer")
    r = config.actor_rollout_ref.rollout
    config.actor_rollout_ref.model.path = model_dir
    config.trainer.n_gpus_per_node = NREPLICAS
    config.trainer.nnodes = 1
    r.name, r.mode, r.nnodes, r.n_gpus_per_node = "sglang", "async", 1, NREPLICAS
    r.tensor_model_parallel_size = r.data_parallel_size = r.pipeline_model_parallel_size = 1
    r.dtype = "float32"           # the checkpoint's; sglang's "auto" would downcast to bf16
    r.load_format = "auto"        # verl's default "dummy" is a random init; auto loads the checkpoint
    r.enforce_eager = True
    r.free_cache_engine = False
    r.gpu_memory_utilization = 0.2
    r.max_num_seqs = 8
    r.prompt_length = 32
    r.response_length = 16
    r.max_model_len = 256
    r.checkpoint_engine.backend = "p2psync"
    r.checkpoint_engine.custom_backend_module = "p2psync.integrations.verl"
    r.checkpoint_engine.update_weights_bucket_megabytes = 1
    OmegaConf.set_struct(r, False)
    r.checkpoint_engine.engine_kwargs = {
        "p2psync": {"rendezvous": "ray", "job_id": JOB, "engine_id": "rollout-{replica}"}}
    r.engine_kwargs.sglang = {"device": "cpu", "attention_backend": "torch_native", "enable_memory_saver": False,
                              "max_total_tokens": 4096, "context_length": 256, "log_level": "info"}
    return config


async def generate_all(replicas, tag):
    out = []
    for i, rep in enumerate(replicas):
        per = []
        for j, prompt in enumerate(PROMPTS):
            res = await rep.server_handle.generate.remote(
                prompt_ids=prompt, request_id=f"{tag}-{i}-{j}",
                sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
            per.append({"tokens": list(res.token_ids), "extra_fields": dict(res.extra_fields or {})})
        out.append(per)
    return out


async def main(out_dir: str) -> None:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    # Imported here, before verl's replica registry would import it with SGLANG_USE_CPU_ENGINE=1 set
    # (verl workers/rollout/replica.py _load_sglang), which makes sglang load sgl_kernel's CPU ops: the CUDA
    # sglang-kernel wheel then needs libcuda.so.1.
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangReplica

    from p2psync.worlds.raynodes import resource

    from .model import make_model
    from .trainer import StandInTrainer

    model_dir = make_model(os.path.join(out_dir, "model"))
    config = build_config(model_dir)
    r = config.actor_rollout_ref.rollout
    ce_config = omega_conf_to_dataclass(r.checkpoint_engine)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)

    pool = RayResourcePool(process_on_nodes=[1], use_gpu=True, max_colocate_count=1, name_prefix="trainer",
                           accelerator_type=resource(0))
    actor_wg = RayWorkerGroup(resource_pool=pool, device_name="cuda", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(StandInTrainer), ce_config=ce_config, model_dir=model_dir))
    replicas = [SGLangReplica(replica_rank=i, config=r, model_config=model_config, gpus_per_node=1)
                for i in range(NREPLICAS)]
    t = time.time()
    await asyncio.gather(*[x.init_standalone() for x in replicas])
    result = {"model_dir": model_dir, "prompts": [list(p) for p in PROMPTS], "new_tokens": NEW_TOKENS,
              "launch_seconds": time.time() - t, "before": await generate_all(replicas, "before"), "updates": [],
              "trainer_nodes": nodes_of(pool.get_placement_groups()),
              "replica_nodes": [nodes_of(x.resource_pool.get_placement_groups()) for x in replicas],
              "server_addresses": [x.server_address for x in replicas]}

    manager = CheckpointEngineManager(config=ce_config, actor_wg=actor_wg, replicas=replicas)
    for n, step in enumerate(STEPS, start=1):
        t = time.time()
        entry = {"update": n, "global_steps": step}
        try:
            entry["metrics"] = await manager.update_weights(global_steps=step)
            entry["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported to the test
            entry["ok"], entry["metrics"], entry["error"] = False, {}, repr(e)
        entry["seconds"] = time.time() - t
        entry["servers"] = await generate_all(replicas, f"u{n}")
        result["updates"].append(entry)
        print("UPDATE", json.dumps(entry), flush=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


def nodes_of(placement_groups) -> list[str]:
    """The addresses of the nodes holding the groups' bundles."""
    import ray
    from ray.util import placement_group_table

    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return sorted({address[node] for pg in placement_groups
                   for node in placement_group_table(pg)["bundles_to_node_id"].values()})


if __name__ == "__main__":
    import ray

    from . import compat

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    compat.setup()
    out = os.path.abspath(args.out)
    ray.init(address=args.address,
             runtime_env={"worker_process_setup_hook": "tests.verl_ray.compat.setup",
                          "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "MOONCAKE_PROTOCOL": "tcp",
                                       "HF_HUB_OFFLINE": "1",
                                       "P2PSYNC_SGLANG_ENDPOINT": json.dumps({
                                           "rendezvous": "ray", "job_id": JOB, "engine_id": "rollout-{replica}",
                                           "version": "v0", "server_url": None})}})
    try:
        asyncio.run(main(out))
    finally:
        ray.shutdown()
