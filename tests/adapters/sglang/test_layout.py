"""sglang layouts: every rank's bytes equal sglang's own `load_weights` on that rank, bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

import dataclasses  # noqa: E402
from functools import lru_cache  # noqa: E402

import torch  # noqa: E402
from tests.helpers.sglang_models import config_dict, hf_config, hf_tensors, produce, sglang_rank, specs  # noqa: E402

from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402
from p2psync.core.errors import ConnectError  # noqa: E402

CASES = [
    *[(kind, tp, 1) for kind in ("qwen2", "qwen3", "deepseek_v3") for tp in (1, 2, 4)],
    ("qwen3_moe", 1, 1), ("qwen3_moe", 2, 2), ("qwen3_moe", 4, 2), ("qwen3_moe", 4, 4),
    ("qwen3-deep", 2, 1), ("qwen3_moe-deep", 2, 2),  # 5 layers: decoder layers share compiled maps
]
#: The replica runs sglang's loader per group on every update; one case per architecture covers it.
REPLICA_CASES = [("qwen2", 2, 1), ("qwen3_moe", 2, 2), ("deepseek_v3", 2, 1)]


@lru_cache(maxsize=None)
def checkpoint(kind: str) -> dict[str, torch.Tensor]:
    return hf_tensors(hf_config(kind))


def sglang_layout(table, sources, mode: str = "copy_map"):
    return SglangEngineTarget(layout=mode).layout(table, sources)


def check_every_rank(kind: str, tp: int, ep: int, mode: str) -> None:
    tensors = checkpoint(kind)
    for rank in range(tp):
        expected, table = sglang_rank(config_dict(hf_config(kind)), tp, ep, rank, tensors)
        layout = sglang_layout(table, specs(tensors), mode)
        if mode == "copy_map":
            assert layout.loader_params == [], "these models' loaders only copy and pad"
            assert layout.rank_model is None, "a copy map without fallbacks keeps no rank model"
            assert all(layout.traced(g) for g in layout.groups()), "sglang's loaders are traced, no element probes"
        else:
            assert len(layout.loader_params) == len(table.params)
        if kind.endswith("-deep"):
            assert layout.shared_groups > 0, "a deep model's layers share compiled maps"
        held = produce(layout, tensors, table)
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.contiguous().view(-1).view(torch.uint8)), (kind, tp, ep, rank, name)


@pytest.mark.parametrize("kind,tp,ep", CASES, ids=[f"{k}-tp{t}-ep{e}" for k, t, e in CASES])
def test_copy_map_equals_sglang_load_on_every_rank(kind, tp, ep):
    check_every_rank(kind, tp, ep, "copy_map")


@pytest.mark.parametrize("kind,tp,ep", REPLICA_CASES, ids=[f"{k}-tp{t}-ep{e}" for k, t, e in REPLICA_CASES])
def test_replica_equals_sglang_load_on_every_rank(kind, tp, ep):
    check_every_rank(kind, tp, ep, "replica")


def test_regions_leave_vocabulary_padding_alone():
    """Rank 1 of 2 holds 64 real vocabulary rows of 96 (160 padded to 192): its regions are the
    bytes sglang writes, zeros in the padding included, and nothing beyond the parameter."""
    tensors = checkpoint("qwen3")
    _, table = sglang_rank(config_dict(hf_config("qwen3")), 2, 1, 1, tensors)
    layout = sglang_layout(table, specs(tensors))
    (group,) = [g for g in layout.groups() if g.outputs == ("model.embed_tokens.weight",)]
    regions = layout.fill(group, {n: tensors[n] for n in group.inputs}, torch.empty(group.nbytes, dtype=torch.uint8))
    param = next(p for p in table.params if p.name == "model.embed_tokens.weight")
    assert sum(r.nbytes for r in regions) == param.nbytes
    assert all(r.param_offset + r.nbytes <= param.nbytes for r in regions)


def table_with(kind: str, **key_changes) -> tuple:
    tensors = checkpoint(kind)
    _, table = sglang_rank(config_dict(hf_config(kind)), 2, 1, 1, tensors)
    return dataclasses.replace(table, layout_key={**table.layout_key, **key_changes}), specs(tensors)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"sglang": "0.5.22"}, "engine runs sglang 0.5.22, the trainer has sglang 0.5.23"),
        ({"enable_eplb": True}, "enable_eplb=True: EPLB moves experts"),
        ({"ep_num_redundant_experts": 2}, "ep_num_redundant_experts=2: redundant experts"),
        ({"init_expert_location": "/tmp/loc.json"}, "init_expert_location='/tmp/loc.json': a non-trivial initial expert location"),
        ({"config_sha256": "0" * 64}, "the HF config in the layout key does not match its hash"),
    ],
    ids=["version", "eplb", "redundant-experts", "expert-location", "config-hash"],
)
def test_connect_rejects_what_a_layout_cannot_reproduce(change, reason):
    table, sources = table_with("qwen3_moe", **change)
    with pytest.raises(ConnectError, match="engine 'engine-0' rank 1: ") as info:
        sglang_layout(table, sources)
    assert reason in str(info.value)


def test_connect_rejects_a_parameter_the_rank_model_disagrees_with():
    table, sources = table_with("qwen3")
    params = list(table.params)
    p = params[3]
    params[3] = dataclasses.replace(p, shape=(p.shape[0] * 2, *p.shape[1:]), nbytes=p.nbytes * 2)
    with pytest.raises(ConnectError, match=f"engine 'engine-0' rank 1 parameter '{p.name}': the engine has"):
        sglang_layout(dataclasses.replace(table, params=tuple(params)), sources)


def test_connect_rejects_a_parameter_no_trainer_tensor_feeds():
    table, sources = table_with("qwen3")
    del sources["model.norm.weight"]
    with pytest.raises(ConnectError, match="parameter 'model.norm.weight': no HF tensor of the trainer is loaded into it"):
        sglang_layout(table, sources)


def test_connect_names_the_hf_tensor_sglangs_loader_refuses():
    table, sources = table_with("qwen3")
    name = "model.layers.1.mlp.up_proj.weight"
    sources[name] = dataclasses.replace(sources[name], shape=(96, 65))
    with pytest.raises(ConnectError, match=f"engine 'engine-0' rank 1: sglang's loader refuses HF tensor '{name}' \\[96, 65\\]"):
        sglang_layout(table, sources)


def test_post_load_on_layout_bytes_derives_what_sglangs_load_derives():
    """DeepSeek's MLA keeps `w_kc`/`w_vc` (not parameters) derived from `kv_b_proj`: an engine whose
    parameters got the layout's bytes and then ran sglang's post-load step holds them as sglang's load does."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, post_load

    tensors = checkpoint("deepseek_v3")
    expected, table = sglang_rank(config_dict(hf_config("deepseek_v3")), 2, 1, 1, tensors)
    layout = sglang_layout(table, specs(tensors))
    engine = build_rank_model(RankSpec(config_dict(hf_config("deepseek_v3")), 2, 1, "bfloat16", 1), "cpu")
    for name, data in produce(layout, tensors, table).items():
        engine.model.get_parameter(name).data.view(-1).view(torch.uint8).copy_(data)
    post_load(engine.model)  # as an endpoint's finish runs it: outside any rank context
    reference = build_rank_model(RankSpec(config_dict(hf_config("deepseek_v3")), 2, 1, "bfloat16", 1), "cpu")
    reference.load(list(tensors.items()))
    for layer, ref in zip(engine.model.model.layers, reference.model.model.layers):
        assert torch.equal(layer.self_attn.w_kc, ref.self_attn.w_kc)
        assert torch.equal(layer.self_attn.w_vc, ref.self_attn.w_vc)


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_a_stored_layout_fills_what_sglangs_load_writes(mode):
    """A layout through its bytes (`layouts.stored`: what the layout cache keeps on disk and trainer
    ranks exchange) fills what sglang's own load writes; the replica rebuilds its rank model."""
    from p2psync.layouts import stored
    from p2psync.layouts.verify import verify

    tensors = checkpoint("qwen3_moe")
    expected, table = sglang_rank(config_dict(hf_config("qwen3_moe")), 2, 2, 1, tensors)
    target = SglangEngineTarget(layout=mode)
    data = stored.encode(target.layout(table, specs(tensors)))
    assert data is not None
    layout = stored.decode(data, table, lambda: target.rank_model(table))
    verify(layout, table, specs(tensors), target)  # what the layout cache checks it against when it reads it
    assert layout.rank_model is None, "built when a parameter the loader produces is first filled"
    held = produce(layout, tensors, table)
    assert (layout.rank_model is None) == (mode == "copy_map")
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor.contiguous().view(-1).view(torch.uint8)), (mode, name)
