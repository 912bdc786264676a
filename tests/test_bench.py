"""`p2psync bench` on the tiny model: both ways measured, and the broadcast baseline real."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("mooncake.engine", reason="the bench's default transport needs mooncake")

from p2psync.cli import main  # noqa: E402


@pytest.mark.slow
def test_bench_json_has_both_ways_and_a_delivered_baseline(capsys):
    assert main(["bench", "--size", "tiny", "--updates", "1", "--raw-mib", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    assert set(result["ways"]) == {"p2p", "broadcast"}
    for name, way in result["ways"].items():
        assert way["verified"], (name, way["mismatches"])  # engines hold the trainer's bytes after this way
        assert way["seconds"] > 0 and way["gbps"] > 0 and len(way["seconds_all"]) == 1, name
        assert set(way["bytes_per_engine_rank"]) == {"engine-0/0", "engine-1/0"}, name
        assert all(n == result["model"]["bytes"] for n in way["bytes_per_engine_rank"].values()), name
        assert sum(way["bytes_per_sender"].values()) == 2 * result["model"]["bytes"], name
    assert all(n > 0 for n in result["ways"]["p2p"]["bytes_per_sender"].values())  # both trainer ranks send
    assert result["ratio_broadcast_over_p2p"] > 0
    for limit in ("memcpy", "raw_transport"):
        assert result["limits"][limit]["gbps"] > 0, limit
    assert len(result["p2p_writing_seconds"]) == 1 and result["p2p_transfer_gbps"] > 0
    memory = result["trainer_memory"]
    assert set(memory) == {"trainer-0", "trainer-1"}
    for trainer, m in memory.items():
        assert m["p2p_first_added_bytes"] > 0, trainer
        assert m["transfer_buffers_bytes"] > 0 and m["largest_group_bytes"] > 0, trainer


@pytest.mark.slow
def test_bench_sglang_engine_ranks_receive_their_shard_only(capsys):
    """sglang TP 2 ranks of a Qwen3-MoE: with p2psync each rank receives exactly the bytes
    of its own parameters (its shard, in bfloat16); the broadcast path sends every rank
    the full tensors. Both leave every rank holding the same bytes."""
    pytest.importorskip("sglang", reason="the sglang engine bench needs sglang")
    from p2psync.bench.model import hf_shapes
    from p2psync.core.types import numel

    assert main(["bench", "--engine", "sglang", "--size", "moe-tiny", "--updates", "1", "--raw-mib", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    full_bf16 = sum(2 * numel(shape) for shape in hf_shapes("moe-tiny").values())
    ranks = {f"sglang-{e}/{r}" for e in range(2) for r in range(2)}
    p2p, broadcast = result["ways"]["p2p"], result["ways"]["broadcast"]
    assert p2p["verified"] and broadcast["verified"], (p2p["mismatches"], broadcast["mismatches"])
    assert set(p2p["bytes_per_engine_rank"]) == set(broadcast["bytes_per_engine_rank"]) == ranks
    assert all(n == full_bf16 for n in broadcast["bytes_per_engine_rank"].values())
    shards = _shard_bytes()
    for name, n in p2p["bytes_per_engine_rank"].items():
        assert n == shards[int(name[-1])], name  # what the rank holds, not the full tensors
        assert n < 0.6 * full_bf16, name
    assert sum(p2p["bytes_per_sender"].values()) == sum(p2p["bytes_per_engine_rank"].values())
    for trainer, m in result["trainer_memory"].items():
        bound = m["transfer_buffers_bytes"] + m["largest_group_bytes"] + m["bucket_bytes"]
        assert 0 < m["p2p_first_added_bytes"] <= bound, trainer


def _shard_bytes() -> dict[int, int]:
    """Bytes of each TP rank's parameters in sglang's own model of it (bfloat16, on meta)."""
    from p2psync.adapters.sglang import rank_params
    from p2psync.bench.model import hf_config
    from p2psync.core.types import ParamSpec

    return {
        rank: sum(ParamSpec(*p).nbytes for p in rank_params(hf_config("moe-tiny"), tp=2, rank=rank))
        for rank in range(2)
    }
