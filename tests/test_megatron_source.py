"""MegatronSource on CPU (gloo, 4 processes): the HF tensors it yields equal, bit for
bit, those of the transformers model whose weights were loaded into Megatron."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("megatron.core", reason="the Megatron source tests need megatron-core (extra 'megatron')")
pytest.importorskip("transformers", reason="the Megatron source tests compare with transformers models")

from megatron_harness import Case, source_worker  # noqa: E402

from p2psync.demo import free_port  # noqa: E402

WORLD = 4
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


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[str]]:
    """Every case in one world of 4 processes (torch and megatron import once per process)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=source_worker, args=(r, WORLD, port, CASES, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        outcome = results.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return outcome


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_source_yields_the_hf_tensors(case: Case, outcomes: dict[str, list[str]]) -> None:
    assert outcomes[case.id] == []
