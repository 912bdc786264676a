"""sglang layouts of the model classes miles ships P2P for, and one whose engine derives buffers
after loading: every TP/EP rank's bytes equal sglang's own `load_weights` on that rank, bit for bit.
Environment: conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402
from model_configs import checkpoint, hf_config  # noqa: E402
from sglang_models import config_dict, produce, sglang_rank, specs  # noqa: E402

from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402

MOE_KINDS = ("glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")  # DeepSeek-V3: test_sglang_layout
CASES = [
    *[(kind, tp, ep) for kind in MOE_KINDS for tp, ep in ((1, 1), (2, 1), (2, 2))],
    *[(kind, tp, 1) for kind in ("gemma", "gemma2") for tp in (1, 2)],
]


def engine_rank(kind: str, tp: int, ep: int, rank: int):
    """sglang's own load of the checkpoint on `rank` (given copies: some loaders change their input)."""
    tensors = {name: t.clone() for name, t in checkpoint(kind).items()}
    return sglang_rank(config_dict(hf_config(kind)), tp, ep, rank, tensors)


@pytest.mark.parametrize("kind,tp,ep", CASES, ids=[f"{k}-tp{t}-ep{e}" for k, t, e in CASES])
def test_copy_map_equals_sglang_load_on_every_rank(kind, tp, ep):
    tensors = checkpoint(kind)
    before = {name: t.clone() for name, t in tensors.items()}
    for rank in range(tp):
        expected, table = engine_rank(kind, tp, ep, rank)
        layout = SglangEngineTarget().layout(table, specs(tensors))
        held = produce(layout, tensors, table)
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.contiguous().view(-1).view(torch.uint8)), (kind, tp, ep, rank, name)
        if kind == "gemma":  # 1 + w is no copy: sglang's loader writes the norms, and only them
            assert layout.loader_params and all(n.endswith("norm.weight") for n in layout.loader_params)
        else:
            assert layout.loader_params == [], "these loaders only copy and pad"
    for name, t in tensors.items():  # every target of a bucket is filled from the same HF tensors
        assert torch.equal(t, before[name]), f"a layout changed the trainer's HF tensor {name}"


def test_indexer_weights_are_in_the_layout():
    """DeepSeek-V3.2's sparse-attention indexer: each of its weights is a group's output."""
    tensors = checkpoint("deepseek_v32")
    _, table = engine_rank("deepseek_v32", 2, 1, 1)
    layout = SglangEngineTarget().layout(table, specs(tensors))
    outputs = {name for group in layout.groups() for name in group.outputs}
    indexer = {p.name for p in table.params if ".indexer." in p.name}
    assert {n.rsplit(".indexer.", 1)[1] for n in indexer} == {
        "wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias",
    }
    assert indexer <= outputs


def test_gemma2_post_load_on_layout_bytes_derives_what_sglangs_load_derives():
    """Gemma 2's norms keep `gemma_weight` (1 + w, a buffer, not a parameter): an engine whose parameters
    got the layout's bytes and then ran sglang's post-load step holds it as sglang's own load does."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, post_load

    tensors = checkpoint("gemma2")
    expected, table = engine_rank("gemma2", 2, 1, 1)
    layout = SglangEngineTarget().layout(table, specs(tensors))
    spec = RankSpec(config_dict(hf_config("gemma2")), 2, 1, "bfloat16", 1)
    engine = build_rank_model(spec, "cpu")
    for name, data in produce(layout, tensors, table).items():
        engine.model.get_parameter(name).data.view(-1).view(torch.uint8).copy_(data)
    post_load(engine.model)
    reference = build_rank_model(spec, "cpu")
    reference.load([(n, t.clone()) for n, t in tensors.items()])
    derived = {n: b for n, b in reference.model.named_buffers() if n.endswith("gemma_weight")}
    assert derived and all(b.ne(1).any() for b in derived.values()), "sglang's load derived no gemma_weight"
    held = dict(engine.model.named_buffers())
    for name, buffer in derived.items():
        assert torch.equal(held[name], buffer), name


@pytest.mark.parametrize("kind,derives", [("gemma2", True), ("deepseek_v32", True), ("glm4_moe", False)])
def test_models_that_derive_tensors_after_loading_are_known(kind, derives):
    """A real server's own transfer-engine endpoint cannot redo a post-load step: `publish_server`
    refuses the models this names."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, derives_after_load

    model = build_rank_model(RankSpec(config_dict(hf_config(kind)), 1, 1, "bfloat16", 0), "meta").model
    assert derives_after_load(model) is derives
