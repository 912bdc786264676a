"""Settings no sglang layout reproduces are refused at connect, naming engine, rank and setting,
before anything is written: expert placements (redundant experts, a non-trivial initial expert
location, EPLB, elastic EP) and drafts (multi-layer EAGLE, a draft checkpoint of its own, a draft
MoE backend other than the target's, a quantized draft, a hot-token map, another algorithm, a draft
the engine did not publish). Environment: conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

import copy  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from tests.helpers.refusals import NoPeers, refused  # noqa: E402
from tests.helpers.sglang_models import config_dict, hf_config, hf_tensors  # noqa: E402

from p2psync.adapters.sglang import serve  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402

PLACEMENTS = {
    "redundant experts": (
        dict(ep_num_redundant_experts=2),
        "ep_num_redundant_experts=2: redundant experts replicate physical experts the layout does not place",
    ),
    "initial expert location": (
        dict(init_expert_location="/ckpt/expert_location.json"),
        "init_expert_location='/ckpt/expert_location.json': a non-trivial initial expert location permutes experts",
    ),
    "EPLB": (dict(enable_eplb=True), "enable_eplb=True: EPLB moves experts between ranks at run time"),
    "elastic EP": (
        dict(elastic_ep_backend="mooncake"),
        "elastic_ep_backend='mooncake': elastic EP re-places experts as EP ranks join and leave",
    ),
    "EP join": (
        dict(ep_join_mode="recover"),
        "ep_join_mode='recover': an EP rank that joins or recovers at run time gets experts the layout does not place",
    ),
}
#: Draft settings: server argument changes, whether the rank publishes its draft, the error.
_MTP = dict(speculative_algorithm="EAGLE")
DRAFTS = {
    "multi-layer EAGLE": (
        dict(_MTP, enable_multi_layer_eagle=True), True,
        "speculative draft (EAGLE): multi-layer EAGLE (enable_multi_layer_eagle) is not reproduced",
    ),
    "own draft checkpoint": (
        dict(_MTP, speculative_draft_model_path="/ckpt/draft"), True,
        "speculative draft (EAGLE): the draft has its own checkpoint (speculative_draft_model_path)",
    ),
    "draft MoE backend": (
        dict(_MTP, speculative_moe_runner_backend="triton"), True,
        "speculative draft (EAGLE): the draft's MoE backend speculative_moe_runner_backend='triton' differs "
        "from the target's 'auto'",
    ),
    "quantized draft": (
        dict(_MTP, speculative_draft_model_quantization="fp8"), True,
        "speculative draft (EAGLE): a quantized draft (speculative_draft_model_quantization='fp8') is not reproduced",
    ),
    "hot-token map": (
        dict(_MTP, speculative_token_map="/ckpt/hot_tokens.pt"), True,
        "speculative draft (EAGLE): a hot-token map (speculative_token_map)",
    ),
    "EAGLE3": (
        dict(speculative_algorithm="EAGLE3"), True,
        "speculative draft (EAGLE3): EAGLE3 drafts are not reproduced",
    ),
    "unpublished draft": (
        _MTP, False,
        "speculative draft (EAGLE): the engine did not publish the draft's parameters: an update would leave "
        "the draft stale",
    ),
}


@pytest.fixture(scope="module")
def engine():
    """One sglang rank (Qwen3-MoE, TP 1), the trainer's HF tensors and a rendezvous."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model

    config = hf_config("qwen3_moe")
    rank_model = build_rank_model(RankSpec(config_dict(config), 1, 1, "bfloat16", 0), "cpu")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="refusals", is_server=True, timeout=5)
    return rank_model, hf_tensors(config), rendezvous


def serve_refused(engine, engine_id: str, changes: dict[str, Any], *, draft: Any = None) -> str:
    """Serve the rank with server settings `changes` as `engine_id` and connect a trainer to it: the
    error text of a refusal with nothing written."""
    rank_model, tensors, rendezvous = engine
    server_args = copy.copy(rank_model.server_args)
    for name, value in changes.items():
        setattr(server_args, name, value)
    endpoint = serve(rank_model.model, server_args, rank_model.model_config, engine_id=engine_id, rank=0,
                     rendezvous=rendezvous, transport=NoPeers(), draft=draft)
    return refused(endpoint, rendezvous, tensors)


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_expert_placements_a_layout_cannot_reproduce_are_refused(engine, case):
    changes, reason = PLACEMENTS[case]
    engine_id = "ep-" + case.replace(" ", "-").lower()
    message = serve_refused(engine, engine_id, changes)
    assert f"engine '{engine_id}' rank 0: {reason}" in message


@pytest.mark.parametrize("case", list(DRAFTS))
def test_drafts_a_layout_cannot_reproduce_are_refused(engine, case):
    changes, published, reason = DRAFTS[case]
    engine_id = "draft-" + case.replace(" ", "-").lower()
    stand_in = torch.nn.Linear(4, 4)  # published as the rank's draft: the key refuses it before any parameter is read
    message = serve_refused(engine, engine_id, changes, draft=stand_in if published else None)
    assert f"engine '{engine_id}' rank 0: {reason}" in message
