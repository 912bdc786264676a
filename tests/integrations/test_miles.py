"""miles' and slime's updater interface: model names and the frameworks' signatures (environment
py). The updaters driven in their actors' call order run in tests/matrix/test_miles.py."""

from __future__ import annotations

import inspect
from argparse import Namespace

import pytest

from p2psync.integrations.miles import P2PSyncUpdateWeight, P2PSyncWeightUpdater


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


def test_a_response_across_an_update_records_both_versions_and_their_spans_on_the_sample():
    from types import SimpleNamespace

    from p2psync.integrations.miles import record_weight_versions

    sample = SimpleNamespace(weight_versions=["3"], metadata={})  # a first turn, 10 tokens, from "3"
    meta = {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 6},
                                                       {"version": "5", "start": 6, "end": 9}]}
    record_weight_versions(sample, meta, offset=10)
    assert sample.weight_versions == ["3", "4", "5"]
    assert sample.metadata["weight_version_spans"] == [["4", 10, 16], ["5", 16, 19]]
    record_weight_versions(sample, {"weight_version": "5", "completion_tokens": 2}, offset=19)  # no spans: one version
    assert sample.weight_versions[-1] == "5" and sample.metadata["weight_version_spans"][-1] == ["5", 19, 21]
    with pytest.raises(ValueError, match="names no weight version"):
        record_weight_versions(sample, {"completion_tokens": 2})


def test_settings_are_typed_from_args_then_the_environment_then_defaults(monkeypatch):
    from p2psync.integrations.miles import UpdaterSettings

    for name in ("RENDEZVOUS", "JOB_ID", "TRANSPORT", "SOURCE", "ENGINE_PREFIX", "HOST_RENDEZVOUS", "CHECK"):
        monkeypatch.delenv(f"P2PSYNC_{name}", raising=False)
    assert UpdaterSettings.of(Namespace()) == UpdaterSettings()
    monkeypatch.setenv("P2PSYNC_RENDEZVOUS", "ray")
    monkeypatch.setenv("P2PSYNC_CHECK", "1")
    monkeypatch.setenv("P2PSYNC_HOST_RENDEZVOUS", "false")
    monkeypatch.setenv("P2PSYNC_JOB_ID", "from-env")
    got = UpdaterSettings.of(Namespace(p2psync_job_id="from-args", p2psync_source="fsdp2", vocab_size=5))
    assert got == UpdaterSettings(rendezvous="ray", job_id="from-args", source="fsdp2", host_rendezvous=False,
                                  check=True)
