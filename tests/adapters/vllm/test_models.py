"""vLLM layouts of the model classes miles ships P2P for that vLLM builds on CPU, bit-exact with
vLLM's own load on every TP rank; and settings no vLLM layout reproduces refused at connect with
nothing written. Environment: conformance-vllm.

DeepSeek-V3.2 and GLM-5 (sparse-attention indexer) are not here: vLLM 0.33.0 does not build them
on CPU (`CpuPlatform.get_attn_backend_cls`: "Sparse Attention is not supported on CPU")."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
pytest.importorskip("transformers", reason="transformers is not installed")

import copy  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from tests.helpers.model_configs import MODELS  # noqa: E402
from tests.helpers.refusals import NoPeers, refused  # noqa: E402
from tests.helpers.sglang_models import produce  # noqa: E402  (engine-agnostic: a layout's bytes over 0xA5)
from tests.helpers.vllm_helpers import CONFIGS, checkpoint, engine_rank, hf_config_dict, specs  # noqa: E402

from p2psync.adapters.vllm.target import VllmEngineTarget  # noqa: E402

#: The new classes vLLM builds on CPU, registered with the vLLM test helpers' configs (which add
#: max_position_embeddings themselves). vLLM's Gemma norm is a copy: it adds 1 in forward.
KINDS = ("glm4_moe", "glm4_moe_lite", "gemma")
for _kind in KINDS:
    _cls, _architecture, _fields = MODELS[_kind]
    _fields = {k: v for k, v in _fields.items() if k != "max_position_embeddings"}
    CONFIGS.setdefault(_kind, dict(cls=_cls, architectures=[_architecture], **_fields))
CASES = [(kind, tp) for kind in KINDS for tp in (1, 2)]


@pytest.mark.parametrize(("kind", "tp"), [
    pytest.param(k, t, id=f"{k}-tp{t}", marks=pytest.mark.conformance(engine="vllm", via=f"model {k}")) for k, t in CASES
])
def test_copy_map_equals_vllm_load_on_every_rank(kind, tp):
    for rank in range(tp):
        expected, table = engine_rank(kind, tp, rank, checkpoint(kind))
        layout = VllmEngineTarget().layout(table, specs(checkpoint(kind)))
        assert layout.loader_params == [], "vLLM's loaders of these models only copy"
        held = produce(layout, checkpoint(kind), table)
        for name, t in expected.items():  # vLLM's own load wrote every parameter; the layout the same bytes
            assert t.count_nonzero() > 0 and torch.equal(held[name], t.contiguous().view(-1).view(torch.uint8)), (
                kind, tp, rank, name,
            )


# -- refusals ---------------------------------------------------------------------------------------

#: ParallelConfig changes -> the reason in the error.
PLACEMENTS = {
    "EPLB": (dict(enable_expert_parallel=True, enable_eplb=True), "enable_eplb=True: EPLB moves experts between ranks"),
    "redundant experts": (
        dict(enable_expert_parallel=True, eplb_config={"num_redundant_experts": 2}),
        "eplb_config.num_redundant_experts=2: redundant experts replicate physical experts the layout does not place",
    ),
    "round-robin placement": (
        dict(enable_expert_parallel=True, expert_placement_strategy="round_robin"),
        "expert_placement_strategy='round_robin': a round-robin placement permutes experts across ranks",
    ),
    "elastic EP": (
        dict(enable_expert_parallel=True, enable_elastic_ep=True),
        "enable_elastic_ep=True: elastic EP re-places experts as EP ranks join and leave",
    ),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A GLM-4.5 MoE vLLM rank (TP 1) on CPU whose engine config runs vLLM's MTP draft of it, the
    trainer's HF tensors and a rendezvous."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    from p2psync.adapters.vllm import shim
    from p2psync.core.rendezvous import Rendezvous

    path = tmp_path_factory.mktemp("glm4_moe")
    (path / "config.json").write_text(json.dumps(hf_config_dict("glm4_moe")))  # with its MTP layer
    config = EngineArgs(
        model=str(path), tensor_parallel_size=1, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
        load_format="dummy", speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    model = shim.build_model(config, 0, "cpu")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="vllm-refusals", is_server=True, timeout=5)
    return model, config, checkpoint("glm4_moe"), rendezvous


def serve_refused(engine, engine_id: str, config: Any) -> str:
    """Serve the rank under `config` as `engine_id` and connect a trainer to it: the error text of a
    refusal with nothing written."""
    from p2psync.adapters.vllm.endpoint import serve

    model, _, tensors, rendezvous = engine
    endpoint = serve(model, config, rank=0, engine_id=engine_id, rendezvous=rendezvous, transport=NoPeers())
    return refused(endpoint, rendezvous, tensors)


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_expert_placements_a_layout_cannot_reproduce_are_refused(engine, case):
    from vllm.config import EPLBConfig

    changes, reason = PLACEMENTS[case]
    config = copy.copy(engine[1])
    config.speculative_config = None
    config.parallel_config = parallel = copy.copy(config.parallel_config)
    for name, value in changes.items():
        setattr(parallel, name, EPLBConfig(**value) if name == "eplb_config" else value)
    engine_id = "ep-" + case.replace(" ", "-").lower()
    assert f"engine '{engine_id}' rank 0: " in (message := serve_refused(engine, engine_id, config))
    assert reason in message


def test_a_speculative_draft_the_backend_does_not_publish_is_refused(engine):
    """vLLM's MTP draft of GLM-4.5: p2psync's vLLM backend publishes the target's parameters only, so
    the update is refused rather than leaving the draft stale."""
    message = serve_refused(engine, "draft-mtp", engine[1])
    assert (
        "engine 'draft-mtp' rank 0: speculative draft (mtp, Glm4MoeMTPModel): the engine did not publish the "
        "draft's parameters, so an update would leave the draft stale"
    ) in message
