"""The sglang engine target through the conformance suite (environment conformance-sglang):
TP rank 1 of 2 (vocabulary padding) with both layouts, bit-exact with sglang's own load over
every byte; FSDP2 and Megatron-Core (TP 2) -> 2 sglang engines of TP 2, each rank its own
process, over every transport, against one sglang engine world."""

from __future__ import annotations

import json

import pytest
import torch

from p2psync.conformance import EngineCase, EngineTargetTests, RoundTripTests
from p2psync.worlds.oracles import SGLANG_FILL
from p2psync.core.types import TargetParam, TargetTable
from tests.helpers.matrix import TRANSPORTS, usable, way_rows

TP, RANK = 2, 1


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
class TestSglangEngine(EngineTargetTests):
    conformance = {"engine": "sglang"}

    @pytest.fixture
    def engine_case(self, mode):
        usable("engine_targets", "sglang")
        import transformers

        from p2psync.adapters.sglang.key import layout_key
        from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, hf_config_dict, require_sglang
        from p2psync.core.plugins import registry

        config = transformers.Qwen3Config(
            vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
        )
        torch.manual_seed(0)
        sources = {n: t.normal_() for n, t in transformers.Qwen3ForCausalLM(config).state_dict().items()}
        engine = build_rank_model(RankSpec(json.loads(config.to_json_string(use_diff=False)), TP, 1, "bfloat16", RANK), "cpu")
        for p in engine.model.parameters():
            p.data.view(-1).view(torch.uint8).fill_(SGLANG_FILL)
        initial = {n: p.data.clone() for n, p in engine.model.named_parameters()}
        engine.load(list(sources.items()))  # the engine's own loader on that rank
        key = layout_key(engine.server_args, hf_config_dict(engine.model_config), str(engine.model_config.dtype), require_sglang())
        table = TargetTable(
            engine_id="e", rank=RANK, world_size=TP, engine="sglang", layout_key=key, transport="mooncake",
            transport_info={}, control_url="", job_id="j",
            params=tuple(
                TargetParam(n, tuple(p.shape), "bfloat16", p.data_ptr(), p.numel() * p.element_size())
                for n, p in engine.model.named_parameters()
            ),
        )
        target = registry().engine_target("sglang")(layout=mode)
        expected = {n: p.data for n, p in engine.model.named_parameters()}
        return EngineCase(table=table, sources=sources, initial=initial, expected=expected, layout=target.layout)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("trainer", ["fsdp2", "megatron"])
class TestToSglang(RoundTripTests):
    """Oracles as for torch engines; each rank holds what sglang's own `load_weights` makes of
    them on that rank (parameters prefilled with 0xA5 bytes on both sides)."""

    conformance = {"engine": "sglang"}

    @pytest.fixture
    def round_trip(self, trainer, transport, worlds):
        return worlds.round_trip(trainer, "sglang", transport)


WAYS = way_rows(["mooncake"])


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "via", "transport"), WAYS, ids=["-".join(w) for w in WAYS])
class TestWaysToSglang(RoundTripTests):
    """The session's other ways of updating, checked as above: gather-free (each
    trainer rank writes the part of every sglang rank that its own rows feed, no gather) and
    delta (after a full first update, every rank gets only what changed).
    Megatron-Core gather-free: each rank writes what its column and row splits, fused QKV and
    gate/up parts and vocabulary rows feed."""

    conformance = {"engine": "sglang"}

    @pytest.fixture
    def round_trip(self, trainer, via, transport, worlds):
        return worlds.round_trip(trainer, "sglang", transport, via=via)
