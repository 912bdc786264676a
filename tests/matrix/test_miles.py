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

Two trainers, both over Mooncake, both bit-exact at the end against an oracle that
does not call p2psync (see `p2psync.worlds`):
- what these frameworks run: a Megatron-Core TP 2 trainer (the `megatron`
  source, selected by `p2psync_source`) into 2 sglang engines of TP 2, each
  rank its own process; every rank holds what sglang's own loader makes of the
  trainer's final HF tensors (environment conformance-sglang);
- the same calls with 2 FSDP2 ranks (the `fsdp2` source) into 2 torch engines
  (environment conformance-torch).
"""


from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from p2psync.conformance import RoundTripTests
from p2psync.worlds import WorldOptions, launch
from p2psync.worlds.engines import engine_main
from p2psync.worlds.trainers import TRAINERS, dump, harness_urls
from p2psync.worlds.world import expected_bytes, held, pair_up, trainer_unavailable
from p2psync.integrations.miles import P2PSyncUpdateWeight, P2PSyncWeightUpdater
from tests.helpers.matrix import WORLDS, usable

#: Ray actor handles in the frameworks; p2psync names engines by position and never calls them.
ENGINES = ["engine handle 0", "engine handle 1"]
#: What the actors pass for a Qwen3 checkpoint: `type(hf_config).__name__.lower()`.
MODEL_NAME = "qwen3config"


def _args(opts: WorldOptions, port: int, source: str) -> Namespace:
    return Namespace(
        p2psync_rendezvous=f"127.0.0.1:{port}", p2psync_job_id=opts.job_id, p2psync_transport="mooncake",
        p2psync_source=source, p2psync_engine_prefix="engine-", p2psync_host_rendezvous=False,
        p2psync_check=True, update_weight_buffer_size=64 << 10, vocab_size=opts.model.config["vocab_size"],
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
    # miles' updater, made anew, counts on from what the engines serve: label "1" named other weights
    assert out["versions"] == [(["1", "1"], "1"), (["2", "2"], "2"), (["3", "3"], "3")]
    metrics = out["metrics"]
    assert metrics["p2psync/bytes"] > 0 and out["popped"]
    assert metrics["p2psync/engines_ok"] == 2 and metrics["p2psync/phase/finish_seconds"] > 0, metrics


def miles_trainer(rank: int, opts: WorldOptions, port: int, results: Any, kind: str) -> None:
    """A trainer rank of the world's `kind` driven by `drive`; then it and the engines save what
    they hold (the trainer by its independent path)."""
    import torch.distributed as dist

    trainer = TRAINERS[kind](rank, opts, port)
    urls = harness_urls(trainer, opts) if rank == 0 else {}  # the engines are up: the updater's connect waits less
    out = drive(_args(opts, port, kind), trainer.model, lambda step: trainer.step(), opts.engine_tp)
    dump(trainer, opts, urls, Path(opts.dump_dir))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "engine"), [("fsdp2", "torch"), ("megatron", "sglang")])
class TestMilesSlime(RoundTripTests):
    conformance = {"transport": "mooncake", "via": "miles/slime"}

    @pytest.fixture
    def round_trip(self, trainer: str, engine: str, tmp_path: Path):
        usable("engine_targets", engine)
        if reason := trainer_unavailable(trainer):
            pytest.skip(reason)
        usable("transports", "mooncake")
        opts = replace(WORLDS[engine], runs=((trainer, "mooncake"),), dump_dir=str(tmp_path), generate=False)

        def go():
            out = launch(opts, engine_main, partial(miles_trainer, kind=trainer),
                         engine_processes=opts.engines * opts.engine_tp)
            _check_outcome(out)
            return pair_up(expected_bytes(opts, tmp_path), held(opts, tmp_path))

        return go
