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
        assert set(way["bytes_per_engine_rank"]) == {"engine-0", "engine-1"}, name
        assert all(n == result["model"]["bytes"] for n in way["bytes_per_engine_rank"].values()), name
        assert sum(way["bytes_per_sender"].values()) == 2 * result["model"]["bytes"], name
    assert all(n > 0 for n in result["ways"]["p2p"]["bytes_per_sender"].values())  # both trainer ranks send
    assert result["ratio_broadcast_over_p2p"] > 0
    for limit in ("memcpy", "raw_transport"):
        assert result["limits"][limit]["gbps"] > 0, limit
    memory = result["trainer_memory"]
    assert set(memory) == {"trainer-0", "trainer-1"}
    for trainer, m in memory.items():
        assert m["peak_bytes"] >= m["before_sync_bytes"] > 0, trainer
        assert m["transfer_buffers_bytes"] > 0 and m["largest_group_bytes"] > 0, trainer
