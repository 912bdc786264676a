"""MegatronSource's local shards on CPU (gloo, 2 processes): every rank's part of every HF
tensor, placed by its ranges, reproduces the tensor the source's gather gives and the HF
checkpoint tensor, and the ranges of a sender group cover every element exactly once (TP
column and row splits, fused QKV, gate/up, padded vocabulary, DP replicas, PP stages, EP
experts, expert TP, MLA)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the Megatron source tests need megatron-core (extra 'megatron')")
pytest.importorskip("transformers", reason="the Megatron source tests compare with transformers models")

from tests.helpers.megatron import Case, check_local_shards, run_world  # noqa: E402

CASES = [
    Case("qwen3", tp=2, vocab_pad=6),  # QKV, gate/up (stride 2), row-parallel, padded vocabulary
    Case("qwen2", tp=2),  # QKV bias
    Case("qwen3"),  # DP 2: each tensor claimed by one replica
    Case("qwen3", pp=2),
    Case("qwen3_moe", tp=2, ep=2),  # whole experts per EP rank
    Case("qwen3_moe", tp=2, etp=2),  # expert TP
    Case("deepseek_v3", tp=2),  # MLA; experts replicated over expert DP 2
    Case("deepseek_v3", tp=2, ep=2, variant="q_proj"),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[str]]:
    return run_world(2, CASES, check_local_shards)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_local_shards_place_into_the_gathered_tensors(case: Case, outcomes: dict[str, list[str]]) -> None:
    assert outcomes[case.id] == []
