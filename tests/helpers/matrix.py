"""What the conformance matrix runs over (transports, engine worlds), and skipping what cannot run here."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from p2psync.worlds import ModelSpec, WorldOptions
from p2psync.worlds.world import unavailable

#: The built-in transports, each run against every engine world.
TRANSPORTS = ("mooncake", "nixl", "samehost", "torchdist")

#: Every engine kind's world, before its runs are known.
WORLDS: dict[str, WorldOptions] = {
    # two torch engines of one rank: transformers models that generate on CPU
    "torch": WorldOptions(engine="torch", engines=2, engine_tp=1, engine_dtype="float32", generate=True),
    # two engines of sglang's own TP 2 ranks (bfloat16, vocabulary padded per rank)
    "sglang": WorldOptions(engine="sglang", engines=2, engine_tp=2, engine_dtype="bfloat16"),
    # two engines of vLLM's own TP 2 ranks, updated through vLLM's weight-transfer flow
    "vllm": WorldOptions(engine="vllm", engines=2, engine_tp=2, engine_dtype="bfloat16"),
}
#: Megatron-Bridge maps experts by Transformer Engine's names only: its world runs a dense
#: MLA DeepSeek-V3 (every layer dense), TP 2 x PP 2.
BRIDGE_MODEL = ModelSpec("deepseek_v3", dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, tie_word_embeddings=False,
))


def way_rows(megatron_transports: Sequence[str]) -> list[tuple[str, str, str]]:
    """(trainer, way, transport) of the rows that update another way than the gathering one:
    FSDP2 gather-free and delta over every transport, Megatron-Core (TP 2) gather-free over
    `megatron_transports` (an engine whose Megatron rows are costly runs one: its gathering
    rows run every transport)."""
    fsdp2 = [("fsdp2", way, t) for way in ("gather-free", "delta") for t in TRANSPORTS]
    return fsdp2 + [("megatron", "gather-free", t) for t in megatron_transports]


def usable(kind: str, name: str) -> None:
    """Skip, with the reason, where the registered `kind` `name` cannot import here."""
    if reason := unavailable(kind, name):
        pytest.skip(reason)
