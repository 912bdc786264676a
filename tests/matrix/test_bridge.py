"""Megatron-Bridge's own DeepSeek mappings as a trainer source (environment bridge): they turn a
Megatron-Core model into the HF tensors bit for bit. Its round trips into torch engines run in
tests/matrix/test_builtin.py (trainer megatron-bridge).

megatron-bridge 0.3.1 does not import whole on a CPU machine (see tests/adapters/megatron/test_bridge.py):
its mapping modules are loaded without the package `__init__`.
"""

from __future__ import annotations

import pytest

from p2psync.worlds.world import trainer_unavailable


@pytest.mark.slow
@pytest.mark.conformance(trainer="megatron-bridge")
def test_bridge_mappings_yield_the_hf_tensors() -> None:
    """MLA DeepSeek-V3 (dense layers: Bridge maps experts by TE's names only) and Qwen3 (Bridge's
    `QKVMapping`), TP2 x PP2: each PP stage's tensors reach every rank through Bridge's
    broadcast; and each rank's local shards, placed, give the same tensors, every element
    held once across the world (the sender group)."""
    if reason := trainer_unavailable("megatron-bridge"):
        pytest.skip(reason)
    pytest.importorskip("transformers", reason="the test compares with a transformers model")
    from tests.helpers.megatron import Case, check_bridge, run_world

    cases = [Case("deepseek_v3", tp=2, pp=2, variant="dense"), Case("qwen3", tp=2, pp=2)]
    assert run_world(4, cases, check_bridge) == {case.id: [] for case in cases}


@pytest.mark.slow
@pytest.mark.conformance(trainer="megatron-bridge-lora")
def test_bridge_lora_adapters_are_bridges_own_export_under_peft_names() -> None:
    """Megatron-Bridge's own LoRA on every linear of a Qwen3 (TP2 x PP2, and TP 2 x DP 2):
    BridgeLoraSource yields exactly what Bridge's own adapter export gives (fused q/k/v and
    gate/up split as Bridge splits them, A repeated), under PEFT's checkpoint names, gathered
    and as each rank's local shards (every element held once across the sender group), with the
    adapters' rank, alpha and target modules."""
    if reason := trainer_unavailable("megatron-bridge-lora"):
        pytest.skip(reason)
    pytest.importorskip("transformers", reason="the test builds its model from a transformers one")
    from tests.helpers.megatron import Case, check_bridge_lora, run_world

    cases = [Case("qwen3", tp=2, pp=2), Case("qwen3", tp=2)]
    assert run_world(4, cases, check_bridge_lora) == {case.id: [] for case in cases}
