"""sglang layouts of the model classes miles ships P2P for, and one whose engine derives buffers
after loading: every TP/EP rank's bytes equal sglang's own `load_weights` on that rank, bit for bit.
Environment: conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402
from tests.helpers.model_configs import checkpoint, hf_config  # noqa: E402
from tests.helpers.sglang_models import config_dict, produce, sglang_rank, specs  # noqa: E402

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


@pytest.mark.parametrize("kind,tp,ep", [
    pytest.param(k, t, e, id=f"{k}-tp{t}-ep{e}", marks=pytest.mark.conformance(engine="sglang", via=f"model {k}"))
    for k, t, e in CASES
])
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


def derived(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What sglang keeps beside the parameters: buffers (a Gemma norm's `gemma_weight`, 1 + w) and
    MLA's `w_kc`/`w_vc`, which its post-load step derives from `kv_b_proj`."""
    out = dict(model.named_buffers())
    for name, module in model.named_modules():
        out |= {f"{name}.{w}": t for w in ("w_kc", "w_vc") if isinstance(t := getattr(module, w, None), torch.Tensor)}
    return out


#: kind -> a tensor sglang derives after loading (which its load must have made or changed).
DERIVED = {
    "gemma2": "model.layers.0.input_layernorm.gemma_weight",
    "glm4_moe_lite": "model.layers.1.self_attn.w_kc",
    "deepseek_v32": "model.layers.1.self_attn.w_kc",
}


@pytest.mark.parametrize("kind", list(DERIVED))
def test_post_load_on_layout_bytes_derives_what_sglangs_load_derives(kind):
    """An engine whose parameters got the layout's bytes, then ran the endpoint's post-load step,
    holds every derived tensor as sglang's own load makes it."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, post_load

    tensors = checkpoint(kind)
    _, table = engine_rank(kind, 2, 1, 1)
    spec = RankSpec(config_dict(hf_config(kind)), 2, 1, "bfloat16", 1)
    engine, fresh = build_rank_model(spec, "cpu"), build_rank_model(spec, "cpu")
    for name, data in produce(SglangEngineTarget().layout(table, specs(tensors)), tensors, table).items():
        engine.model.get_parameter(name).data.view(-1).view(torch.uint8).copy_(data)
    post_load(engine.model)  # as an endpoint's finish runs it
    reference = build_rank_model(spec, "cpu")
    reference.load([(n, t.clone()) for n, t in tensors.items()])
    held, want, initial = derived(engine.model), derived(reference.model), derived(fresh.model)
    assert held.keys() == want.keys()
    before = initial.get(DERIVED[kind])  # MLA's w_kc exists only once derived
    assert before is None or not torch.equal(want[DERIVED[kind]], before), "sglang's load derived nothing here"
    for name, tensor in want.items():
        assert torch.equal(held[name], tensor), name


@pytest.mark.parametrize("kind,derives", [("gemma2", True), ("deepseek_v32", True), ("glm4_moe", False)])
def test_models_that_derive_tensors_after_loading_are_known(kind, derives):
    """A real server's own transfer-engine endpoint cannot redo a post-load step: `publish_server`
    refuses the models this names."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, derives_after_load

    model = build_rank_model(RankSpec(config_dict(hf_config(kind)), 1, 1, "bfloat16", 0), "meta").model
    assert derives_after_load(model) is derives
