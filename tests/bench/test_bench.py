"""`p2psync bench`: every way measured and verified against the engines' own load, bytes
measured, each way's time split and bound, results kept as JSON.

Runs in tox env py (torch engines); the sglang and vLLM engine benches run in
conformance-sglang and conformance-vllm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("mooncake.engine", reason="the bench's default transport needs mooncake")

from p2psync.cli import main  # noqa: E402
from p2psync.core.report import CONNECT_PHASES  # noqa: E402


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *args, "--updates", "1", "--raw-mib", "16", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_common(result: dict[str, Any], ways: set[str]) -> None:
    """What every run must show: every way verified, its time split, its bound, the ratios,
    the machine before and after."""
    assert set(result["ways"]) == ways
    for name, way in result["ways"].items():
        assert way["verified"], (name, way["mismatches"])
        assert way["seconds"] > 0 and len(way["seconds_all"]) == 1, name
        phases = way["phases"]["trainer-0"]
        gathers = "gather" in phases or (name == "gather-free" and way["gathered_bytes"] == 0)
        # a p2psync update's seconds end when its last engine finished; its finish phase also
        # holds the report's broadcast to the other trainer ranks
        before_finish = sum(t for phase, t in phases.items() if phase != "finish")
        assert gathers and before_finish <= way["seconds"] * 1.05 + 0.01, (name, phases)
        assert way["bound_seconds"] == max(way["gathers_alone_seconds"], way["wire_seconds_at_raw"]), name
        assert way["over_bound"] == pytest.approx(way["seconds"] / way["bound_seconds"]), name
        # the machine's cores spent something in an update long enough for a busy core to count
        # clock ticks (tiny models' take under one), and at most all of their time over the
        # seconds they were counted (the update's, and the barrier before it); each core's
        # count is whole ticks, read at both ends of the window: up to a tick more per core at each
        # (a run counted 0.310 CPU-seconds in a 0.3097 s window of 1 core's worth)
        cores = result["machine"]["cores"]
        tick = 2 * 0.01 * cores
        window = way["cpu_window_seconds"]
        assert window >= way["seconds"] and 0 <= way["cpu_seconds"] <= window * cores + tick, name
        assert way["cpu_seconds"] > 0 or window < 0.05, name
        assert way["cores_busy"] == pytest.approx(way["cpu_seconds"] / (window * cores)), name
    # where each session's connect went, phase by phase, on every trainer rank (the session's own clock)
    sessions = {"gathering", "gather-free"} if "gather-free" in ways else {"gathering"}
    for trainer, connects in result["connect"].items():
        assert set(connects) == sessions and all(list(c) == list(CONNECT_PHASES) for c in connects.values()), trainer
    broadcasts = {w for w in ways if w.startswith("broadcast")}
    assert set(result["ratios"]) == {f"{w}/p2p" for w in ways - {"p2p"}} | {f"{w}/gather-free" for w in broadcasts}
    for when in ("limits", "limits_after"):
        assert len(result[when]["load_average"]) == 3
        assert result[when]["raw_transport"]["gbps"] > 0 and result[when]["raw_gloo"]["gbps"] > 0
    assert result["machine"]["cores"] > 0 and "torch" in result["versions"]


def _check_broadcast_bytes(way: dict[str, Any], receivers: int) -> None:
    """The bytes the broadcast's members measured sending add up to every receiver getting the
    payload once (gloo's tree and the chain: relays send what the trainer does not), beside a
    little for the commands."""
    payload = next(iter(way["bytes_per_engine_rank"].values()))
    assert set(way["bytes_per_engine_rank"].values()) == {payload}
    sent = sum(way["bytes_per_sender"].values())
    assert receivers * payload <= sent <= receivers * payload * 1.01 + (1 << 16)


@pytest.mark.slow
def test_bench_torch_engines_both_ways_measured_and_saved(capsys, tmp_path):
    """Torch engines (float32, full tensors): p2psync and the broadcast both deliver the model
    to every engine, the broadcast's bytes measured, and --save keeps everything as JSON."""
    args = ["bench", "--size", "tiny", "--updates", "1", "--raw-mib", "16", "--json", "--save", str(tmp_path)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    _check_common(result, {"p2p", "gather-free", "broadcast", "broadcast-chain"})
    model_bytes = result["setup"]["model"]["bytes"]
    p2p, broadcast = result["ways"]["p2p"], result["ways"]["broadcast"]
    for way in (p2p, result["ways"]["gather-free"]):
        assert way["bytes_per_engine_rank"] == {"engine-0/0": model_bytes, "engine-1/0": model_bytes}
        assert sum(way["bytes_per_sender"].values()) == 2 * model_bytes and all(way["bytes_per_sender"].values())
    # torch engines hold copies of every tensor: nothing is gathered, each rank sends its own rows
    free = result["ways"]["gather-free"]
    assert 0 < free["gather_free_bytes"] < model_bytes  # trainer-0's rows of every tensor
    assert (free["gathered_bytes"], p2p["gather_free_bytes"]) == (0, 0)
    assert broadcast["reference"] and broadcast["gathers_step"] == p2p["gathers_step"]  # float32 both
    for name in ("broadcast", "broadcast-chain"):
        _check_broadcast_bytes(result["ways"][name], receivers=2)
    _check_memory_bound(result)
    saved = list(tmp_path.glob("*-torch-tiny.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == result


@pytest.mark.slow
def test_bench_sglang_engine_ranks_receive_their_shard_only(capsys):
    """sglang TP 2 ranks of a Qwen3-MoE: with p2psync each rank receives exactly the bytes of
    its own parameters (its shard, in bfloat16); both broadcasts send every rank the full
    tensors. Every way leaves every rank holding the bytes of sglang's own load of the
    trainer's float32 tensors (the verl-style broadcast); the fair broadcast gathers in
    bfloat16 as p2psync does."""
    pytest.importorskip("sglang", reason="the sglang engine bench needs sglang")
    result = _run(capsys, "--engine", "sglang", "--size", "moe-tiny")
    _check_engine_bench(result, "sglang", _shard_bytes("sglang"))


@pytest.mark.slow
def test_bench_megatron_trainer_sends_its_own_shards_into_sglang_ranks(capsys):
    """Megatron-Core as the bench's trainer (TP 2, EP 2 for the experts): the same shards land
    as the broadcast's reference, and the default session gathers nothing."""
    pytest.importorskip("sglang", reason="the sglang engine bench needs sglang")
    pytest.importorskip("megatron.core", reason="the Megatron trainer needs megatron-core")
    result = _run(capsys, "--engine", "sglang", "--size", "moe-tiny", "--trainer", "megatron")
    assert result["setup"]["trainer"] == "megatron"
    _check_engine_bench(result, "sglang", _shard_bytes("sglang"))
    assert result["ways"]["gather-free"]["gathered_bytes"] == 0


@pytest.mark.slow
def test_bench_vllm_engine_ranks_receive_their_shard_only(capsys):
    """The same with vLLM's own TP 2 ranks of the Qwen3-MoE."""
    pytest.importorskip("vllm", reason="the vLLM engine bench needs vLLM")
    result = _run(capsys, "--engine", "vllm", "--size", "moe-tiny")
    _check_engine_bench(result, "vllm", _shard_bytes("vllm"))


@pytest.mark.slow
def test_bench_sglang_fp8_every_way_quantizes_on_the_trainer(capsys):
    """--fp8 block-linear: sglang TP 2 ranks of moe-tiny serve an fp8 checkpoint at block [16, 16]
    (each rank holds 16 rows of k, v and every expert's gate and up: no larger block divides them).
    Every way leaves every rank's weights and scales equal to the reference's; the p2psync ways send
    each rank exactly its fp8 shard and scales, the broadcasts every rank the whole fp8 checkpoint:
    sizes computed here from the config's dimensions."""
    pytest.importorskip("sglang", reason="the sglang engine bench needs sglang")
    from p2psync.bench.model import MOE_CONFIGS

    result = _run(capsys, "--engine", "sglang", "--size", "moe-tiny", "--fp8", "block-linear")
    assert result["setup"]["engine"]["fp8"] == {"quantizer": "block-linear", "block": [16, 16]}
    _check_common(result, {"p2p", "gather-free", "broadcast", "broadcast-chain", "broadcast-fp32"})
    ways = result["ways"]
    assert [n for n, w in ways.items() if w["reference"]] == ["broadcast-fp32"]
    shard, full, tensors, full_bf16 = _fp8_bytes(MOE_CONFIGS["moe-tiny"], tp=2, block=16)
    ranks = {f"sglang-{e}/{r}" for e in range(2) for r in range(2)}
    for name in ("p2p", "gather-free"):
        way = ways[name]
        assert way["bytes_per_engine_rank"] == dict.fromkeys(ranks, shard), name
        assert sum(way["bytes_per_sender"].values()) == 4 * shard, name
    # gathering, each engine rank is one sender's: each sender's count is whole ranks' shards
    assert all(n % shard == 0 and n > 0 for n in ways["p2p"]["bytes_per_sender"].values())
    assert ways["gather-free"]["gathered_bytes"] > 0  # the quantized groups: a block's scale needs the whole block
    for name in ("broadcast", "broadcast-chain", "broadcast-fp32"):
        received = ways[name]["bytes_per_engine_rank"]
        assert set(received) == ranks
        # the fp8 checkpoint, each tensor aligned to 64 bytes in the flat buffer, far below its bf16
        assert all(full <= n < full + 64 * tensors for n in received.values()), (name, received, full)
        assert full + 64 * tensors < full_bf16
        _check_broadcast_bytes(ways[name], receivers=4)


@pytest.mark.parametrize(
    "size,tp,block", [("moe-tiny", 2, 16), ("moe-tiny", 1, 32), ("moe-tiny", 4, 8), ("moe", 2, 128), ("moe", 4, 64)]
)
def test_fp8_bench_block_is_the_largest_sglang_builds(size, tp, block):
    """--fp8's block: sglang builds the rank at it, and refuses twice it (its own check of the TP split)."""
    pytest.importorskip("sglang", reason="sglang's rank models need sglang")
    from p2psync.adapters.sglang import rank_params
    from p2psync.bench import BenchOptions
    from p2psync.bench.fp8 import engine_config

    config = engine_config(BenchOptions(engine="sglang", size=size, engine_tp=tp, fp8="block-linear"))
    assert config["quantization_config"]["weight_block_size"] == [block, block]
    assert any(dtype == "float8_e4m3fn" for _, _, dtype in rank_params(config, tp=tp, rank=0))
    config["quantization_config"]["weight_block_size"] = [2 * block, 2 * block]
    with pytest.raises(ValueError, match="not divisible by weight quantization block"):
        rank_params(config, tp=tp, rank=0)


def test_fp8_bench_is_refused_before_anything_starts(capsys):
    assert main(["bench", "--engine", "sglang", "--size", "moe-tiny", "--fp8", "block-cubic"]) == 2
    assert "unknown fp8 quantizer 'block-cubic'; choose one of ['block-linear'," in capsys.readouterr().err
    assert main(["bench", "--size", "tiny", "--fp8", "block-linear"]) == 2
    assert "--fp8 runs sglang engines, not torch" in capsys.readouterr().err
    assert main(["bench", "--delta", "--fp8", "block-linear"]) == 2
    assert "--fp8 is a case of the bench of the ways" in capsys.readouterr().err


def test_the_cluster_predictor_sizes_fp8_engines_as_the_config_does():
    """The cluster predictor's shapes of an fp8 run: each rank's fp8 shard and scales, and the full
    checkpoint the broadcasts send, as `_fp8_bytes` computes them from the config."""
    from p2psync.bench.cluster_predict import _shapes
    from p2psync.bench.model import MOE_CONFIGS

    for tp, block in ((2, 16), (4, 8)):
        setup = {"model": {"size": "moe-tiny"}, "cluster": {"tp": tp},
                 "engine": {"fp8": {"quantizer": "block-linear", "block": [block, block]}}}
        shapes = _shapes(setup)
        layers = len(shapes.layer_kinds)
        rank, full = shapes.ranks[0], shapes.full
        shard, checkpoint, _, _ = _fp8_bytes(MOE_CONFIGS["moe-tiny"], tp=tp, block=block)
        assert rank.part_bytes("embed") + rank.part_bytes("final") + layers * rank.part_bytes("moe") == shard
        assert full.part_bytes("embed") + full.part_bytes("final") + layers * full.part_bytes("moe") == checkpoint


def _fp8_bytes(c: dict[str, int], *, tp: int, block: int) -> tuple[int, int, int, int]:
    """Of the Qwen3-MoE config `c` with every linear projection in fp8 and its float32 scale per
    [block, block] (norms, embeddings, the router and the head in bfloat16): bytes of one of sglang's
    TP ranks (fused qkv, w13, w2), bytes of the full checkpoint, its tensor count, and its bytes in
    bfloat16."""
    from math import ceil

    def fp8(rows: int, cols: int, n: int = 1) -> int:
        return n * (rows * cols + 4 * ceil(rows / block) * ceil(cols / block))

    h, hd, inter, experts = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"], c["num_experts"]
    q, kv, layers = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["num_hidden_layers"]
    plain = 2 * (2 * h + 2 * hd + experts * h)  # two norms, q and k norms, the router

    def rest(ranks: int) -> int:  # embeddings and head (their rows over TP), final norm
        return 2 * (2 * c["vocab_size"] // ranks * h + h)

    kv_rank = max(1, c["num_key_value_heads"] // tp) * hd  # sglang replicates KV heads where TP exceeds them
    rank = fp8(q // tp + 2 * kv_rank, h) + fp8(h, q // tp)
    rank += fp8(2 * inter // tp, h, experts) + fp8(h, inter // tp, experts)
    full = fp8(q, h) + 2 * fp8(kv, h) + fp8(h, q) + fp8(inter, h, 2 * experts) + fp8(h, inter, experts)
    bf16 = 2 * (q * h + 2 * kv * h + h * q + 3 * experts * inter * h)
    quantized = 4 + 3 * experts
    tensors = layers * (2 * quantized + 5) + 3
    return (layers * (rank + plain) + rest(tp), layers * (full + plain) + rest(1), tensors,
            layers * (bf16 + plain) + rest(1))


def _check_engine_bench(result: dict[str, Any], kind: str, shards: dict[int, int]) -> None:
    from p2psync.bench.model import hf_shapes
    from p2psync.core.types import numel

    _check_common(result, {"p2p", "gather-free", "broadcast", "broadcast-chain", "broadcast-fp32"})
    ranks = {f"{kind}-{e}/{r}" for e in range(2) for r in range(2)}
    ways = result["ways"]
    assert ways["broadcast-fp32"]["reference"]
    full_bf16 = sum(2 * numel(shape) for shape in hf_shapes("moe-tiny").values())
    for name in ("broadcast", "broadcast-chain", "broadcast-fp32"):
        assert set(ways[name]["bytes_per_engine_rank"]) == ranks
        assert all(n >= full_bf16 for n in ways[name]["bytes_per_engine_rank"].values())
        _check_broadcast_bytes(ways[name], receivers=4)
    p2p = ways["p2p"]
    for way in (p2p, ways["gather-free"]):
        for name, n in way["bytes_per_engine_rank"].items():
            assert n == shards[int(name[-1])], name  # what the rank holds, not the full tensors
            assert n < 0.6 * full_bf16, name
        assert sum(way["bytes_per_sender"].values()) == sum(way["bytes_per_engine_rank"].values())
    assert ways["gather-free"]["gather_free_bytes"] > 0
    # p2psync and the fair broadcast gather in bfloat16, the verl-style broadcast in float32
    assert ways["broadcast"]["gathers_step"] == p2p["gathers_step"] != ways["broadcast-fp32"]["gathers_step"]
    _check_memory_bound(result)


def _check_memory_bound(result: dict[str, Any]) -> None:
    """From the first update on, p2psync adds to a trainer rank's RSS at most its transfer
    buffers, its largest parameter group and two buckets' gathers (one produced while the
    next is gathered; measured alone), beside 2 MiB of the interpreter's own objects."""
    for trainer, m in result["trainer_memory"].items():
        bound = m["transfer_buffers_bytes"] + m["largest_group_bytes"] + 2 * m["gathers_peak_bytes"] + (2 << 20)
        assert m["p2p_bound_bytes"] == bound and m["gathers_peak_bytes"] > 0, trainer
        assert 0 < m["p2p_first_added_bytes"] <= bound and m["p2p_later_added_bytes"] <= bound, trainer
        free = "gather-free_"
        bound = m[f"{free}transfer_buffers_bytes"] + m[f"{free}largest_group_bytes"] + 2 * m[f"{free}gathers_peak_bytes"]
        assert m["gather-free_bound_bytes"] == bound + (2 << 20), trainer
        assert m["gather-free_first_added_bytes"] <= bound + (2 << 20), trainer
        assert m["gather-free_later_added_bytes"] <= bound + (2 << 20), trainer


def _shard_bytes(kind: str) -> dict[int, int]:
    """Bytes of each TP rank's parameters in the engine's own model of it (bfloat16, on meta)."""
    from p2psync.bench.model import hf_config
    from p2psync.core.types import ParamSpec

    if kind == "sglang":
        from p2psync.adapters.sglang import rank_params
    else:
        from p2psync.adapters.vllm import rank_params
    return {rank: sum(ParamSpec(*p).nbytes for p in rank_params(hf_config("moe-tiny"), tp=2, rank=rank))
            for rank in range(2)}


def test_unknown_way_is_refused_before_anything_starts(capsys):
    assert main(["bench", "--size", "tiny", "--ways", "p2p", "broadcast-fp32"]) == 2
    assert "broadcast-fp32" in capsys.readouterr().err  # torch engines hold float32: no such way


def test_benchmarks_readme_tables_are_generated_from_the_saved_results():
    """benchmarks/README.md's tables are what benchmarks/tables.py makes of benchmarks/results/*.json."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "tables.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_bench_delta_sends_fewer_bytes_and_ends_bit_exact(capsys, tmp_path):
    """--delta: the trainer takes AdamW steps; delta updates send each bf16 engine rank fewer
    bytes than a full update, more at the larger learning rate, and a checked delta update
    leaves every parameter equal to a full update's. --save keeps it apart from the tables'
    results (a delta/ folder)."""
    args = ["bench", "--delta", "--size", "tiny", "--updates", "2", "--lr", "1e-6", "1e-4", "--json",
            "--save", str(tmp_path)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] and result["setup"]["engine"]["dtype"] == "bfloat16"
    low, high = result["per_lr"]["1e-06"], result["per_lr"]["0.0001"]
    for r in (low, high):
        assert r["delta_updates"] == [2, 2]  # both engines' ranks took deltas in every timed update
        full = r["bytes_per_engine_rank"]["full"]
        assert set(full.values()) == {2 * result["setup"]["model"]["parameters"]}  # bf16: 2 bytes per element
        assert 0 < r["changed_fraction"] < 1
        assert set(r["seconds"]) == {"p2p-delta", "p2p-delta-unproven", "p2p", "broadcast"}
    assert low["changed_fraction"] < high["changed_fraction"]
    assert low["full_over_delta_bytes"] > high["full_over_delta_bytes"] > 1
    assert all(m["delta_bytes"] > 0 for m in result["trainer_memory"].values())
    assert len(list((tmp_path / "delta").glob("*-torch-tiny.json"))) == 1
