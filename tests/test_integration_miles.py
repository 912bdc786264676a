"""miles' and slime's updater interface, driven in the order their Megatron actors call it.

slime's `MegatronTrainRayActor` (and miles' before its WeightUpdater refactor):
build the updater with `(args, model, weights_getter=..., model_name=...,
quantization_config=...)`, `model` being the list of model chunks and
`model_name` `type(hf_config).__name__.lower()`; per `update_weights`: connect
when there are new engines (`connect_rollout_engines(engines, lock,
engine_gpu_counts=..., engine_gpu_offsets=...)`), a gloo barrier,
`update_weights()`, then (ci_test) an engine's weight version must equal
`updater.weight_version`. miles' WeightUpdater interface:
`connect_rollout_engines(engines, engine_gpu_counts=..., engine_gpu_offsets=...)`,
`update_weights()`, `pop_metrics()`.

Two trainers, both over Mooncake, both bit-exact at the end:
- what these frameworks run: a Megatron-Core TP 2 trainer (the `megatron`
  source, selected by `p2psync_source`) into 2 sglang engines of TP 2, each
  rank its own process; every rank holds what sglang's own loader makes of the
  trainer's final HF tensors (needs sglang: `tox -e conformance-sglang`);
- the same calls with 2 FSDP2 ranks (the `fsdp2` source) into 2 torch engines,
  which runs wherever p2psync's test extras are installed.
"""

from __future__ import annotations

import inspect
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("mooncake.engine", reason="the test syncs over Mooncake (pip install 'p2psync[mooncake]')")

import torch

from p2psync.demo import DemoOptions, engine_main, join_trainer_world, launch, start_trainer
from p2psync.integrations.miles import P2PSyncUpdateWeight, P2PSyncWeightUpdater

#: Ray actor handles in the frameworks; p2psync names engines by position and never calls them.
ENGINES = ["engine handle 0", "engine handle 1"]
#: What the actors pass for a Qwen3 checkpoint: `type(hf_config).__name__.lower()`.
MODEL_NAME = "qwen3config"


def _args(opts: DemoOptions, port: int, source: str, engine_prefix: str) -> Namespace:
    return Namespace(
        p2psync_rendezvous=f"127.0.0.1:{port}", p2psync_job_id=opts.job_id, p2psync_transport=opts.transport,
        p2psync_source=source, p2psync_engine_prefix=engine_prefix, p2psync_host_rendezvous=False,
        p2psync_check=True, update_weight_buffer_size=64 << 10, vocab_size=256,
    )


def _engine_versions(updater: P2PSyncUpdateWeight) -> list[str]:
    """Every engine's weight version (slime's ci_test asks one engine at random)."""
    from p2psync.core.control import post

    session = updater._session
    assert session is not None and updater.rollout_engines is not None
    return [
        post(session.tables[e][0].control_url, "info", {}, token=session.token, timeout=30)["version"]
        for e in updater.engine_ids(updater.rollout_engines)
    ]


def drive(args: Namespace, model: Any, train_step: Callable[[int], None], gpus_per_engine: int) -> dict[str, Any]:
    """slime's updater for two steps, then miles' WeightUpdater for one, each called as their
    actors call it (collective: every trainer rank runs this); returns versions and metrics."""
    import torch.distributed as dist

    counts = [gpus_per_engine] * len(ENGINES)
    offsets = [i * gpus_per_engine for i in range(len(ENGINES))]
    out: dict[str, Any] = {"versions": []}

    updater = P2PSyncUpdateWeight(args, [model], weights_getter=dict, model_name=MODEL_NAME, quantization_config=None)
    for step in (1, 2):
        train_step(step)
        if step == 1:  # num_new_engines > 0
            updater.connect_rollout_engines(ENGINES, object(), engine_gpu_counts=counts, engine_gpu_offsets=offsets)
            dist.barrier()
        updater.update_weights()
        out["versions"].append((_engine_versions(updater), str(updater.weight_version)))
    updater.disconnect_rollout_engines()

    updater = P2PSyncWeightUpdater(
        args, [model], weights_getter=dict, model_name=MODEL_NAME, quantization_config=None,
        iterator_factory=None, parallel_state=None, is_lora=False,
    )
    train_step(3)
    updater.connect_rollout_engines(ENGINES, engine_gpu_counts=counts, engine_gpu_offsets=offsets)
    updater.update_weights()
    out["metrics"] = updater.pop_metrics()
    out["popped"] = updater.last_report is None
    out["versions"].append((_engine_versions(updater), str(updater.weight_version)))
    updater.close()
    return out


def _check_outcome(out: dict[str, Any]) -> None:
    assert out["versions"] == [(["1", "1"], "1"), (["2", "2"], "2"), (["1", "1"], "1")]
    assert out["metrics"]["p2psync/bytes"] > 0 and out["popped"]


def fsdp2_trainer(rank: int, opts: DemoOptions, port: int, results: Any) -> None:
    """An FSDP2 rank training the demo model with AdamW; rank 0 saves its final tensors."""
    import torch.distributed as dist

    _, model = start_trainer(rank, opts, port)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(step: int) -> None:
        batch = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    out = drive(_args(opts, port, "fsdp2", "engine-"), model, train_step, gpus_per_engine=1)
    full = {name.removeprefix("_orig_mod."): p.detach().full_tensor().clone() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    if rank == 0:
        torch.save(full, f"{opts.dump_dir}/trainer.pt")
        results.put(out)


def megatron_trainer(rank: int, opts: DemoOptions, port: int, results: Any) -> None:
    """A Megatron-Core TP rank of the Qwen3 the sglang ranks build (the demo's tiny shape); `perturb`
    stands in for the optimizer step. Rank 0 saves the final HF tensors, gathered by a source of its own."""
    import torch.distributed as dist
    from megatron_harness import Case, checkpoint, hf_model, load_hf, megatron_model, perturb
    from sglang_e2e import TP, engine_ids

    from p2psync.adapters.megatron import MegatronSource

    hf = checkpoint(hf_model("qwen3", seed=0))  # transformers saves differently once torch.distributed is up
    rendezvous = join_trainer_world(rank, opts, port)
    for engine in engine_ids(opts):  # sglang ranks take longer to build than connect waits
        rendezvous.read_engine(engine, timeout=600)
    model = megatron_model(Case("qwen3", tp=opts.trainers))
    load_hf(model, hf, "qwen3")

    args = _args(opts, port, "megatron", "sglang-")
    out = drive(args, model, lambda step: perturb(model, seed=step), gpus_per_engine=TP)
    source = MegatronSource(model, "qwen3")
    final = {name: t.clone() for name, t in source.gather([s.name for s in source.param_specs()]).items()}
    dist.destroy_process_group()
    if rank == 0:
        torch.save(final, f"{opts.dump_dir}/trainer.pt")
        results.put(out)


@pytest.mark.slow
def test_slime_then_miles_megatron_to_sglang_is_bit_exact(tmp_path):
    pytest.importorskip("sglang", reason="sglang (sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
    pytest.importorskip("megatron.core", reason="megatron-core (extra 'megatron') is not installed")
    from sglang_e2e import TP, engine_rank, rank_bytes

    opts = DemoOptions(size="tiny", trainers=2, engines=len(ENGINES) * TP, transport="mooncake", progress=False,
                       dump_dir=str(tmp_path))
    _check_outcome(launch(opts, engine_rank, megatron_trainer))
    for where, (expected, held) in rank_bytes(opts).items():
        assert held.keys() == expected.keys(), where
        for name, tensor in expected.items():
            assert torch.equal(held[name].view(torch.uint8), tensor.view(torch.uint8)), (where, name)


@pytest.mark.slow
def test_slime_then_miles_fsdp2_to_torch_is_bit_exact(tmp_path):
    opts = DemoOptions(size="tiny", trainers=2, engines=len(ENGINES), transport="mooncake", progress=False,
                       dump_dir=str(tmp_path))
    _check_outcome(launch(opts, engine_main, fsdp2_trainer))

    trained = torch.load(tmp_path / "trainer.pt")
    for engine in ("engine-0", "engine-1"):
        held = torch.load(tmp_path / f"{engine}.pt")
        for name, tensor in trained.items():
            assert torch.equal(held[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (engine, name)


def test_megatron_architecture_from_model_name():
    from p2psync.integrations.miles import megatron_architecture

    assert megatron_architecture("qwen3moeconfig") == "qwen3_moe"  # type(hf_config).__name__.lower()
    assert megatron_architecture("deepseekv3config") == "deepseek_v3"
    assert megatron_architecture("qwen2") == "qwen2"  # --model-name
    with pytest.raises(ValueError, match="llamaconfig"):
        megatron_architecture("llamaconfig")


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
