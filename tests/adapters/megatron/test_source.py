"""MegatronSource on CPU (gloo, 4 processes): the HF tensors it yields equal, bit for
bit, those of the transformers model whose weights were loaded into Megatron; and, on one
process, Megatron's logits with those weights equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the Megatron source tests need megatron-core (extra 'megatron')")
pytest.importorskip("transformers", reason="the Megatron source tests compare with transformers models")

from tests.helpers.megatron import Case, check_forward, run_world  # noqa: E402

CASES = [
    Case("qwen3", tp=2),
    Case("qwen3", pp=2),
    Case("qwen2", tp=2, pp=2),
    Case("qwen3_moe", tp=2, ep=2, etp=1),
    Case("qwen3_moe", tp=2, ep=2, etp=2),
    Case("deepseek_v3"),
    Case("deepseek_v3", tp=2),
    Case("deepseek_v3", tp=2, pp=2),
    Case("deepseek_v3", tp=2, ep=2),
    Case("deepseek_v3", tp=2, variant="q_proj"),
]
FORWARD_CASES = [
    Case("qwen2"),
    Case("qwen3"),
    Case("qwen3_moe"),
    Case("deepseek_v3"),
    Case("deepseek_v3", variant="q_proj"),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[str]]:
    return run_world(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_source_yields_the_hf_tensors(case: Case, outcomes: dict[str, list[str]]) -> None:
    assert outcomes[case.id] == []


@pytest.fixture(scope="module")
def forward_outcomes() -> dict[str, list[str]]:
    return run_world(1, FORWARD_CASES, check_forward)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=[c.id for c in FORWARD_CASES])
def test_the_name_table_places_weights_where_megatron_computes_as_transformers(
    case: Case, forward_outcomes: dict[str, list[str]]
) -> None:
    """MLA (rope dimensions interleaved, as DeepSeek-V3 ships them), fused QKV per KV group, gate/up,
    routers with their scaling: a weight in the wrong place changes the logits."""
    assert forward_outcomes[case.id] == []
