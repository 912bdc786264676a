"""vLLM targets a layout cannot reproduce are refused at connect, naming engine and rank (and the
parameter where one is at fault), before any peer is opened (environment conformance-vllm)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

from p2psync.core.types import TargetTable  # noqa: E402
from tests.helpers.doubles import refusal  # noqa: E402
from tests.helpers.vllm_helpers import checkpoint, engine_rank  # noqa: E402

TP, RANK = 2, 1


def key(**changes: Any):
    return lambda table: {"layout_key": {**table.layout_key, **changes}}


def reshaped(name: str):
    def change(table: TargetTable) -> dict[str, Any]:
        params = tuple(
            dataclasses.replace(p, shape=(p.shape[0] - 1, *p.shape[1:]), nbytes=p.nbytes - p.nbytes // p.shape[0])
            if p.name == name else p for p in table.params
        )
        return {"params": params}

    return change


REFUSALS = {
    "another vllm version": (key(vllm="0.0.1"), "engine runs vllm 0.0.1, layouts are pinned to"),
    "quantized other than fp8": (key(quantization="awq"), "quantization 'awq' is not supported (fp8 is)"),
    "quantized while loading": (
        key(quantization="fp8"), "quantization 'fp8' without a quantization_config in the HF config"
    ),
    "pipeline parallel": (key(pp=2), "only tensor parallelism is supported (pp=2"),
    "data parallel": (key(dp=2), "only tensor parallelism is supported (pp=1, dp=2"),
    "expert parallel": (key(ep=True), "only tensor parallelism is supported (pp=1, dp=1, ep=True)"),
    "tp and ranks disagree": (key(tp=4), "tp 4 differs from the engine's 2 ranks"),
    "a parameter of another shape": (
        reshaped("model.layers.0.mlp.down_proj.weight"), "parameter 'model.layers.0.mlp.down_proj.weight'"
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_target_no_layout_reproduces_is_refused_before_anything_is_written(case: str) -> None:
    change, reason = REFUSALS[case]
    tensors = checkpoint("qwen3")
    _, table = engine_rank("qwen3", TP, RANK, tensors)
    valid_rank0 = dataclasses.replace(table, rank=0)
    message, opened = refusal([valid_rank0, dataclasses.replace(table, **change(table))], tensors)
    assert f"engine 'engine' rank {RANK}" in message and reason in message, message
    assert opened == []
