"""vLLM layouts: the bytes of every rank equal vLLM's own `load_weights` on that rank."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("transformers", reason="transformers is not installed")

from collections.abc import Mapping  # noqa: E402

import torch  # noqa: E402
from tests.helpers.vllm_helpers import checkpoint, engine_rank, specs  # noqa: E402

from p2psync.adapters.vllm.target import VllmEngineTarget  # noqa: E402
from p2psync.core.layout import Layout  # noqa: E402
from p2psync.core.types import TargetTable  # noqa: E402

CASES = [(kind, tp) for kind in ("qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3") for tp in (1, 2, 4)]
CASES += [("qwen3-deep", 2), ("qwen3_moe-deep", 2)]  # 5 layers: decoder layers share compiled maps


def produce(
    layout: Layout, tensors: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every group filled into a garbage buffer, its regions written over zeroed parameters:
    a region too many shows as garbage, a region missing as zeros."""
    held = {name: torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8) for name, t in like.items()}
    for group in layout.groups():
        out = torch.randint(0, 256, (group.nbytes,), dtype=torch.uint8)
        for r in layout.fill(group, {name: tensors[name] for name in group.inputs}, out):
            region = out[r.buffer_offset : r.buffer_offset + r.nbytes]
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = region
    return held


def assert_same_bytes(held: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert held.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(held[name], t.contiguous().view(-1).view(torch.uint8)), name


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_layout_bytes_equal_vllm_load_on_every_rank(kind, tp):
    tensors = checkpoint(kind)
    for rank in range(tp):
        expected, table = engine_rank(kind, tp, rank, tensors)
        assert all(t.count_nonzero() > 0 for t in expected.values()), "vLLM left a parameter unloaded"
        for mode in ("copy_map", "replica"):
            layout = VllmEngineTarget(layout=mode).layout(table, specs(tensors))
            if mode == "copy_map":
                assert all(layout.traced(g) for g in layout.groups()), "vLLM's loaders are traced, no element probes"
            if kind.endswith("-deep"):
                assert layout.shared_groups > 0, "a deep model's layers share compiled maps"
            assert_same_bytes(produce(layout, tensors, expected), expected)


def test_copy_map_needs_no_model_and_writes_the_loaders_zeros_into_the_vocabulary_padding():
    tensors = checkpoint("qwen2")
    expected, table = engine_rank("qwen2", 4, 3, tensors)
    layout = VllmEngineTarget().layout(table, specs(tensors))
    assert layout.loader_params == [] and layout.rank_model is None
    embed = next(p for p in table.params if p.name == "model.embed_tokens.weight")
    # vocab 250 padded to 256, 64 rows per rank: rank 3 holds 58 real rows and 6 rows of vLLM's zeros
    assert sum(r.nbytes for r in layout.regions_of(embed.name)) == embed.nbytes
    assert not expected[embed.name][58:].any() and expected[embed.name][:58].count_nonzero() > 0
    qkv = next(g for g in layout.groups() if g.outputs[0].endswith("0.self_attn.qkv_proj.weight"))
    # tp 4 > 1 KV head: the one KV head is replicated, so rank 3 reads the whole of k and v.
    assert {name.rsplit(".", 2)[-2] for name in qkv.inputs} == {"q_proj", "k_proj", "v_proj"}
    assert layout.copy_dtype(qkv) == "bfloat16"


def test_bytes_that_are_not_a_pure_copy_fall_back_to_the_replica_per_parameter(monkeypatch):
    from vllm.model_executor.models import utils

    def scaled(param, loaded_weight):  # a loader that computes: not reproducible by copies
        param.data.copy_(loaded_weight * 2 + 1)

    monkeypatch.setattr(utils, "default_weight_loader", scaled)  # what AutoWeightsLoader gives plain parameters
    tensors = checkpoint("qwen3")
    expected, table = engine_rank("qwen3", 2, 1, tensors)
    layout = VllmEngineTarget().layout(table, specs(tensors))
    fallback = set(layout.loader_params)
    assert fallback and all(name.endswith("norm.weight") for name in fallback)
    assert layout.rank_model is not None
    assert_same_bytes(produce(layout, tensors, expected), expected)


def test_a_table_that_disagrees_with_the_rebuilt_model_is_rejected():
    from p2psync.core.errors import ConnectError

    tensors = checkpoint("qwen3")
    _, table = engine_rank("qwen3", 2, 0, tensors)
    wrong = TargetTable(**{**table.__dict__, "params": table.params[1:]})
    with pytest.raises(ConnectError, match="engine 'engine' rank 0 parameter .*: vllm's rank model has it, the engine did not publish it"):
        VllmEngineTarget().layout(wrong, specs(tensors))


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_a_stored_layout_fills_what_vllms_load_writes(mode):
    """A layout through its bytes (`layouts.stored`: what the layout cache keeps on disk and trainer
    ranks exchange) fills what vLLM's own load writes; the replica rebuilds its rank model."""
    from p2psync.layouts import stored
    from p2psync.layouts.verify import verify

    tensors = checkpoint("qwen3_moe")
    expected, table = engine_rank("qwen3_moe", 2, 1, tensors)
    target = VllmEngineTarget(layout=mode)
    data = stored.encode(target.layout(table, specs(tensors)))
    assert data is not None
    layout = stored.decode(data, table, lambda: target.rank_model(table))
    verify(layout, table, specs(tensors), target)  # what the layout cache checks it against when it reads it
    assert layout.rank_model is None, "built when a parameter the loader produces is first filled"
    assert_same_bytes(produce(layout, tensors, expected), expected)
    assert (layout.rank_model is None) == (mode == "copy_map")
