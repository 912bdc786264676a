"""miles' and slime's updater interface, driven in the order their Megatron actors call it.

slime's `MegatronTrainRayActor` (and miles' before its WeightUpdater refactor):
build the updater with `(args, model, weights_getter=..., model_name=...,
quantization_config=...)`; per `update_weights`: connect when there are new
engines (`connect_rollout_engines(engines, lock, engine_gpu_counts=...,
engine_gpu_offsets=...)`), a gloo barrier, `update_weights()`, then (ci_test) an
engine's weight version must equal `updater.weight_version`. miles' WeightUpdater
interface: `connect_rollout_engines(engines, engine_gpu_counts=...,
engine_gpu_offsets=...)`, `update_weights()`, `pop_metrics()`.

The trainer is 2 FSDP2 ranks (p2psync's Megatron source is not there yet; the
updater takes any registered TrainerSource), the engines 2 torch engines in
their own processes, over Mooncake. Engine bytes equal the trainer's at the end,
bit for bit.
"""

from __future__ import annotations

import inspect
from argparse import Namespace

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("mooncake.engine", reason="the test syncs over Mooncake (pip install 'p2psync[mooncake]')")

import torch

from p2psync.demo import DemoOptions, engine_main, launch, start_trainer
from p2psync.integrations.miles import P2PSyncUpdateWeight, P2PSyncWeightUpdater


def _args(opts, port):
    return Namespace(
        p2psync_rendezvous=f"127.0.0.1:{port}", p2psync_job_id=opts.job_id, p2psync_transport=opts.transport,
        p2psync_source="fsdp2", p2psync_engine_prefix="engine-", p2psync_host_rendezvous=False, p2psync_check=True,
        update_weight_buffer_size=64 << 10,
    )


def _train_step(model, optimizer, step):
    batch = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _engine_version(updater):
    from p2psync.core.control import post

    table = updater._session.tables["engine-1"][0]
    return post(table.control_url, "info", {}, token=updater._session.token, timeout=30)["version"]


def trainer(rank, opts, port, results):
    import torch.distributed as dist

    _, model = start_trainer(rank, opts, port)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engines, lock = ["engine handle 0", "engine handle 1"], object()  # Ray actor handles in slime; unused
    out = {"versions": [], "metrics": None}

    # slime / miles (classic): UpdateWeightFromDistributed's signature and call order
    updater = P2PSyncUpdateWeight(
        _args(opts, port), [model], weights_getter=lambda: {}, model_name="qwen3", quantization_config=None
    )
    for step in range(1, 3):
        _train_step(model, optimizer, step)
        if step == 1:  # num_new_engines > 0
            updater.connect_rollout_engines(engines, lock, engine_gpu_counts=[1, 1], engine_gpu_offsets=[0, 1])
            dist.barrier()
        updater.update_weights()
        if rank == 0:
            out["versions"].append((_engine_version(updater), str(updater.weight_version)))
    updater.disconnect_rollout_engines()

    # miles: WeightUpdater's signature and call order
    updater = P2PSyncWeightUpdater(
        _args(opts, port), [model], weights_getter=lambda: {}, model_name="qwen3", quantization_config=None,
        iterator_factory=None, parallel_state=None, is_lora=False,
    )
    _train_step(model, optimizer, 3)
    updater.connect_rollout_engines(engines, engine_gpu_counts=[1, 1], engine_gpu_offsets=[0, 1])
    updater.update_weights()
    metrics = updater.pop_metrics()
    if rank == 0:
        out["versions"].append((_engine_version(updater), str(updater.weight_version)))
        out["metrics"] = metrics
        out["ok"] = updater.last_report is None  # popped

    full = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}
    updater.close()
    dist.destroy_process_group()
    if rank == 0:
        torch.save({k.removeprefix("_orig_mod."): v for k, v in full.items()}, f"{opts.dump_dir}/trainer.pt")
        results.put(out)


@pytest.mark.slow
def test_slime_then_miles_call_order_is_bit_exact(tmp_path):
    opts = DemoOptions(size="tiny", trainers=2, engines=2, transport="mooncake", progress=False, dump_dir=str(tmp_path))
    out = launch(opts, engine_main, trainer)

    assert out["versions"] == [("1", "1"), ("2", "2"), ("1", "1")]
    assert out["metrics"]["p2psync/bytes"] > 0
    trained = torch.load(tmp_path / "trainer.pt")
    for engine in ("engine-0", "engine-1"):
        held = torch.load(tmp_path / f"{engine}.pt")
        for name, tensor in trained.items():
            assert torch.equal(held[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (engine, name)


def test_signatures_match_the_frameworks():
    # slime: UpdateWeightFromDistributed(args, model, weights_getter, *, model_name, quantization_config)
    params = inspect.signature(P2PSyncUpdateWeight).parameters
    assert list(params)[:3] == ["args", "model", "weights_getter"]
    assert params["model_name"].kind is inspect.Parameter.KEYWORD_ONLY
    connect = inspect.signature(P2PSyncUpdateWeight.connect_rollout_engines).parameters
    assert list(connect) == ["self", "rollout_engines", "rollout_engine_lock", "engine_gpu_counts", "engine_gpu_offsets"]
    # miles: WeightUpdater(args, model, *, weights_getter, ..., iterator_factory, parallel_state, is_lora, lora_sync_config)
    params = inspect.signature(P2PSyncWeightUpdater).parameters
    for name in ("weights_getter", "model_name", "quantization_config", "iterator_factory", "parallel_state", "is_lora"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    connect = inspect.signature(P2PSyncWeightUpdater.connect_rollout_engines).parameters
    assert list(connect) == ["self", "rollout_engines", "engine_gpu_counts", "engine_gpu_offsets"]
    with pytest.raises(NotImplementedError):
        P2PSyncWeightUpdater(Namespace(), [], is_lora=True)
