"""The sglang engine target through the conformance suite (environment `conformance-sglang`):
TP rank 1 of 2 (vocabulary padding) with both layouts, and FSDP2 or Megatron-Core (TP 2) -> 2 sglang
engines of TP 2, each rank its own process, bit-exact with sglang's own load of the trainer's final weights."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`"
)
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the sglang test helpers

from sglang_e2e import TP as E2E_TP  # noqa: E402
from sglang_e2e import engine_ids, engine_rank, rank_bytes, trainer  # noqa: E402
from test_builtin import TRANSPORTS, need  # noqa: E402

from p2psync.conformance import EngineCase, EngineTargetTests, RoundTrip, RoundTripTests  # noqa: E402
from p2psync.demo import DemoOptions, launch  # noqa: E402
from p2psync.core.types import TargetParam, TargetTable  # noqa: E402

TP, RANK = 2, 1


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
class TestSglangEngine(EngineTargetTests):
    conformance = {"engine": "sglang"}

    @pytest.fixture
    def engine_case(self, mode):
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
        return EngineCase(table=table, sources=sources, expected=expected, layout=target.layout)


def sglang_round_trip(transport: str, tmp_path: Path, trainer: Callable[..., None]) -> RoundTrip:
    """2 `trainer` ranks -> 2 sglang engines of TP 2, 2 updates over `transport`: per engine rank,
    sglang's own load of the trainer's final HF tensors and the bytes the rank holds."""

    def go():
        opts = DemoOptions(
            size="tiny", trainers=2, engines=2 * E2E_TP, updates=2, transport=transport,
            bucket_bytes=64 << 10, progress=False, dump_dir=str(tmp_path),
        )
        result = launch(opts, engine_rank, trainer)
        assert result["buckets"] > 1
        for report in result["reports"]:
            assert report.ok and all(e.checked and e.bytes > 0 for e in report.engines.values()), report.format()
        return rank_bytes(opts)

    return go


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestFSDP2ToSglang(RoundTripTests):
    conformance = {"trainer": "fsdp2", "engine": "sglang"}

    @pytest.fixture
    def round_trip(self, transport, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        return sglang_round_trip(transport, tmp_path, trainer)


@pytest.mark.slow
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
class TestMegatronToSglang(RoundTripTests):
    """Megatron-Core TP 2 (dense Qwen3, the demo's tiny model that the sglang ranks build)."""

    conformance = {"trainer": "megatron", "engine": "sglang"}

    @pytest.fixture
    def round_trip(self, transport, tmp_path):
        need(TRANSPORTS[transport], f"transport {transport}")
        need("megatron.core", "the Megatron trainer (extra 'megatron')")
        from megatron_harness import e2e_trainer

        return sglang_round_trip(transport, tmp_path, partial(e2e_trainer, engine_ids=engine_ids))
