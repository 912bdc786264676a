"""Bytes each engine rank receives: p2psync (its own bytes) against vLLM's nccl_m2n backend,
whose destination plan (vLLM's own `resolve_parameter_destinations`) sends a fused parameter's
HF tensors whole to every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("transformers", reason="transformers is not installed")

from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from tests.helpers.vllm_helpers import checkpoint, engine_rank, specs  # noqa: E402

from p2psync.adapters.vllm.target import VllmEngineTarget  # noqa: E402
from p2psync.layouts.layout import EngineLayout  # noqa: E402

CASES = [("qwen2", 4), ("qwen3_moe", 2), ("deepseek_v3", 2)]
FUSED = ("qkv_proj", "gate_up_proj", "experts.w13", "experts.w2")


def m2n_bytes(layout: EngineLayout, tensors: dict[str, torch.Tensor], tp: int) -> dict[str, int]:
    """Per engine parameter, the bytes nccl_m2n delivers to this rank: the local shard for a
    parameter it resolves directly, every feeding HF tensor whole for the rest."""
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    names = list(tensors)
    destinations = resolve_parameter_destinations(
        layout.rank_model.model, names, [tensors[n].dtype for n in names], [tuple(tensors[n].shape) for n in names],
        num_workers=tp, shard_axis_size=tp, allow_direct=True,
    )
    param_of = {name: group.outputs[0] for group in layout.groups() for name in group.inputs}
    out: dict[str, int] = defaultdict(int)
    for name, d in zip(names, destinations):
        if name in param_of:  # else fed to no parameter of this rank (a tied lm_head)
            received = d.tensor if d.direct else tensors[name]
            out[param_of[name]] += received.numel() * received.element_size()
    return out


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_each_rank_receives_only_its_own_bytes_where_m2n_sends_fused_parameters_whole(kind, tp):
    tensors = {n: t.to(torch.bfloat16) for n, t in checkpoint(kind).items()}  # same wire dtype for both
    rows = []
    for rank in range(tp):
        params, table = engine_rank(kind, tp, rank, tensors)
        layout = VllmEngineTarget(layout="replica").layout(table, specs(tensors))  # same regions as the copy map; keeps its rank model
        ours = {p.name: sum(r.nbytes for r in layout.regions_of(p.name)) for p in table.params}
        theirs = m2n_bytes(layout, tensors, tp)
        for name, t in params.items():
            assert ours[name] <= t.numel() * t.element_size(), name  # never more than the rank holds
            if t.dtype == torch.bfloat16:  # p2psync sends engine-dtype bytes (an fp32 router bias: 2x the wire's)
                assert ours[name] <= theirs[name], name
            rows.append((rank, name, ours[name], theirs[name]))
        fused = [n for n in params if any(part in n for part in FUSED)]
        assert fused and all(ours[n] < theirs[n] for n in fused), "m2n sends fused parameters whole"
        assert sum(ours.values()) < sum(theirs.values())
    print(f"\n{kind} tp{tp}: bytes received per rank and parameter (p2psync / nccl_m2n)")
    for rank, name, a, b in rows:
        print(f"  rank {rank} {name:60s} {a:>9d} {b:>9d}")

