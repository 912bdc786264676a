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
