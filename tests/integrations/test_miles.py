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
