"""`p2psync plan`: per-rank shapes, the real plan per pipeline stage, loads and predictions."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from p2psync.cli import main
from p2psync.planner.cluster import Cluster
from p2psync.planner.predict import predict
from p2psync.planner.presets import PRESETS, PUBLISHED_PARAMS, preset
from p2psync.planner.shapes import analytic_shapes

# A small Qwen3-MoE-style config: layer 0 dense (mlp_only_layers), layer 1 MoE.
SMALL = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=160, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
    tie_word_embeddings=False, torch_dtype="bfloat16",
)


def kimi_cluster() -> Cluster:
    return Cluster(train_ranks=256, train_tp=8, train_pp=8, train_ep=32, engines=8, engine_tp=32, engine_ep=32,
                   engine_dtype="fp8")


def test_small_config_bytes_per_rank_by_hand() -> None:
    """TP 2, EP 2, bf16 (2 bytes), by hand."""
    s = analytic_shapes(SMALL, tp=2, ep=2, dtype="bf16")
    h, hd, bf = 64, 16, 2
    norms = 2 * h  # input_layernorm, post_attention_layernorm: replicated
    qk_norm = 2 * hd  # Qwen3 q_norm, k_norm: replicated
    qkv = (4 // 2 + 2 * (2 // 2)) * hd * h  # q heads and kv heads split over TP 2
    o = h * (4 // 2) * hd
    gate_up, down = 2 * (96 // 2) * h, h * (96 // 2)  # dense MLP over TP 2
    router = 8 * h  # replicated
    experts = (8 // 2) * (2 * 32 * h + h * 32)  # 4 experts per EP rank, tp/ep = 1: whole experts
    embed = (160 + 32) // 2 * h  # vocab padded to 64 -> 192, over TP 2
    final = h + embed  # norm + lm_head
    for rank in range(2):
        r = s.ranks[rank]
        assert r.part_bytes("embed") == embed * bf
        assert r.part_bytes("dense") == (norms + qk_norm + qkv + o + gate_up + down) * bf
        assert r.part_bytes("moe") == (norms + qk_norm + qkv + o + router + experts) * bf
        assert r.part_bytes("final") == final * bf
    assert s.layer_kinds == ["dense", "moe"]
    # two stages: stage 0 holds embed + layer 0, stage 1 layer 1 + final
    c = Cluster(train_ranks=4, train_pp=2, engines=2, engine_tp=2, engine_ep=2)
    p = predict(c, s)
    d0 = s.ranks[0].part_bytes("embed") + s.ranks[0].part_bytes("dense")
    d1 = s.ranks[0].part_bytes("moe") + s.ranks[0].part_bytes("final")
    assert [p.plans[0].load[x] for x in (0, 1)] == [2 * d0, 2 * d0]  # 4 targets over 2 senders
    assert all(v == d0 + d1 for v in p.receiver_bytes.values())


def test_tp_beyond_kv_heads_replicates_kv_and_experts_split_inside_when_ep_below_tp() -> None:
    s = analytic_shapes(SMALL, tp=4, ep=2, dtype="bf16")
    moe = {p.name.rpartition(".")[0].rpartition(".")[2] + "." + p.name.rpartition(".")[2]: p.shape
           for p in s.ranks[0].parts["moe"]}
    assert moe["qkv_proj.weight"] == ((1 + 2 * 1) * 16, 64)  # 1 q head, kv head replicated
    assert moe["experts.w13_weight"] == (4, 2 * 16, 64)  # 4 experts, intermediate 32 over tp/ep = 2
    assert moe["experts.w2_weight"] == (4, 64, 16)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_published_parameter_counts(name: str) -> None:
    s = analytic_shapes(preset(name), 4, 4, "bf16")  # TP 4: GLM-4.7-Flash's 20 heads do not split 8 ways
    assert abs(s.numel_total / PUBLISHED_PARAMS[name] - 1) < 0.02


def test_every_engine_rank_has_one_sender_per_stage_and_kimi_builds_fast() -> None:
    c = kimi_cluster()
    t0 = time.perf_counter()
    p = predict(c, analytic_shapes(preset("Kimi-K2"), 32, 32, "fp8"), t0=t0)
    elapsed = time.perf_counter() - t0
    print(f"Kimi-K2 plan (256 trainer ranks -> 8 engines x 32 ranks, analytic shapes) built in {elapsed:.3f} s")
    assert elapsed < 20  # the bar is 2 s; measured and printed above, asserted only loosely
    targets = {(f"engine-{e}", r) for e in range(8) for r in range(32)}
    assert len(p.plans) == 8
    for stage, plan in enumerate(p.plans):
        assert {(t.engine_id, t.rank) for t in plan.assignment} == targets  # each exactly once (dict keys)
        assert set(plan.assignment.values()) <= set(c.stage_ranks(stage))
    # every sender sends (256 targets per stage, 32 senders): all parallel
    assert all(v > 0 for v in p.sender_bytes.values())
    # a Kimi-K2 engine rank holds about 1/32 of the ~1 TB fp8 model
    assert all(30e9 < v < 36e9 for v in p.receiver_bytes.values())
    assert p.lower_bound_s <= p.p2p_s < p.broadcast_s


def test_engines_with_equal_parallelism_share_units() -> None:
    """Stage of 2 senders, 2 engines of 2 ranks: miles' rule gives each sender one engine rank of both engines."""
    c = Cluster(train_ranks=2, engines=2, engine_tp=2, engine_ep=2)
    p = predict(c, analytic_shapes(SMALL, 2, 2, "bf16"))
    a = {(t.engine_id, t.rank): s for t, s in p.plans[0].assignment.items()}
    assert a[("engine-0", 0)] == a[("engine-1", 0)] != a[("engine-0", 1)] == a[("engine-1", 1)]


@pytest.mark.parametrize("bmodel", ["ring", "star", "tree"])
def test_broadcast_predicted_slower_than_p2p_with_engine_ep(bmodel: str) -> None:
    c = Cluster(train_ranks=16, train_pp=2, engines=2, engine_tp=8, engine_ep=8)
    p = predict(c, analytic_shapes(preset("Qwen3-30B-A3B"), 8, 8, "bf16"), bmodel)
    assert p.broadcast_s > p.p2p_s
    assert max(p.bcast_nic_recv.values()) > 4 * max(p.receiver_bytes.values())  # ~EP times more per engine rank


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        analytic_shapes(dict(SMALL, architectures=["MixtralForCausalLM"]), 2, 1, "bf16")


def test_stage_split_covers_every_layer_once() -> None:
    c = Cluster(train_ranks=64, train_pp=8)
    spans = [c.stage_layers(s, 61) for s in range(8)]
    assert [i for r in spans for i in r] == list(range(61))
    assert [len(r) for r in spans] == [8, 8, 8, 8, 8, 7, 7, 7]


def test_cli_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--preset", "Qwen3-30B-A3B", "--nodes", "2", "--train-tp", "4", "--train-ep", "8",
               "--engine-tp", "8", "--engine-ep", "8", "--shapes", "analytic", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["shapes"] == "analytic shapes (requested)"
    assert d["cluster"]["engines"] == 2 and d["cluster"]["train_ranks"] == 16
    assert d["broadcast"]["predicted_s"] > d["p2p"]["predicted_s"] > 0
    assert "Gb/s" in d["link_model"]
    # what the stages hold gathered (bf16 HF tensors) adds up to the whole model, vocab padded to 64
    assert sum(s["held_bytes_trainer_dtype"] for s in d["stages"]) == 2 * d["parameters"]


def test_cli_text_states_shapes_and_link_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    assert main(["plan", "--config", str(cfg), "--train-ranks", "4", "--engines", "2", "--engine-tp", "2",
                 "--engine-ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "shapes from sglang" in out or "analytic shapes (" in out
    assert "link model:" in out and "prediction" in out


def test_png_draws_or_says_what_to_install(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "nics.png"
    rc = main(["plan", "--preset", "Qwen3-30B-A3B", "--nodes", "1", "--shapes", "analytic", "--png", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "pip install matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and png.stat().st_size > 0


def test_compare_miles_prints_every_published_row_with_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    from p2psync.planner.compare import compare
    from p2psync.planner.setups import SETUPS

    rows = compare(shapes="analytic")
    miles = [r for r in rows if r["group"] == "miles"]
    assert len(miles) == 12  # 6 rows of miles' table, broadcast and P2P each: every row modelled
    assert {r["setup"] for r in rows} == {s.name for s in SETUPS}
    assert {"Perplexity Kimi-K2", "vLLM sharded_rdt Qwen3-235B", "NeMo-RL DeepSeek-V3"} <= {r["setup"] for r in rows}
    for r in rows:
        middle = sum(r["published_s"]) / 2
        assert r["error"] == pytest.approx(r["predicted_s"] / middle - 1)
    broadcast = [r for r in miles if r["published_way"] == "broadcast"]
    assert all(r["all_ways_s"]["broadcast"] > r["all_ways_s"]["p2psync"] > r["all_ways_s"]["gather-free"] for r in rows)
    assert broadcast[-1]["predicted_s"] > 5 * broadcast[0]["predicted_s"]  # the broadcast's cost grows with scale
    assert main(["plan", "--compare-miles", "--shapes", "analytic"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "| miles GLM-5 |" in out and "| Perplexity Kimi-K2 |" in out
    assert out.count("%") >= len(rows)  # an error per row


def test_whole_update_by_hand() -> None:
    """Gathers from the trainer parallelism, production, wire and control add up as the model says."""
    from p2psync.planner.update import Costs, whole_update

    c = Cluster(train_ranks=16, train_tp=4, train_ep=16, engines=2, engine_tp=2, engine_ep=2, nic_gbps=400,
                nvlink_gbytes=100)
    engine, trainer = analytic_shapes(SMALL, 2, 2, "bf16"), analytic_shapes(SMALL, 1, 1, "bf16")
    p = predict(c, engine)
    costs = Costs(produce_gbytes=10, pause_s=0.5, finish_s=0.25)
    u = whole_update(p, trainer, costs)
    held, experts = trainer.full_bytes(range(2), True, True)[0], trainer.full_expert_bytes(range(2), True, True)
    assert experts == 8 * (2 * 32 * 64 + 64 * 32) * 2  # 8 experts of layer 1, bf16
    # dense over TP 4 inside a node (NVLink 100 GB/s); experts over EP 16, two nodes: the GPU's NIC share, 50 GB/s
    gathers = 3 / 4 * (held - experts) / 100e9 + 15 / 16 * experts / 50e9
    ways = u["ways"]
    assert ways["p2psync"]["gathers_s"] == pytest.approx(gathers)
    assert ways["p2psync"]["production_s"] == pytest.approx(max(p.sender_bytes.values()) / 10e9)
    assert ways["p2psync"]["post_load_s"] == 0  # bf16 engines: no post-load by default
    # the small model's stage is one bucket: nothing overlaps, gathers, production and wire add up
    assert max(p.stage_full_bytes) < costs.bucket_bytes
    assert ways["p2psync"]["total_s"] == pytest.approx(0.75 + gathers + ways["p2psync"]["production_s"] + p.p2p_s)
    # in buckets of a hundredth of a stage's bytes the slowest stage sets the pace, plus the others' first and last
    stages = [gathers, ways["p2psync"]["production_s"], p.p2p_s]
    fine = whole_update(p, trainer, Costs(produce_gbytes=10, pause_s=0.5, finish_s=0.25,
                                          bucket_bytes=max(p.stage_full_bytes) // 100))["ways"]["p2psync"]
    assert fine["total_s"] == pytest.approx(0.75 + max(stages) + (sum(stages) - max(stages)) / 100, rel=0.02)
    assert ways["broadcast"]["total_s"] == pytest.approx(
        0.75 + gathers + ways["broadcast"]["production_s"] + p.broadcast_s)
    assert ways["gather-free"]["gathers_s"] == 0 and ways["gather-free"]["wire_s"] == p.floor_s
    fp8 = whole_update(predict(Cluster(train_ranks=2, engines=1, engine_tp=2, engine_dtype="fp8"),
                               analytic_shapes(SMALL, 2, 1, "fp8")), trainer, Costs())
    assert fp8["ways"]["p2psync"]["post_load_s"] > 0  # fp8 engines: Kimi-K2's published post-load rate


def test_setup_prints_published_beside_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--setup", "NeMo-RL DeepSeek-V3", "--shapes", "analytic"]) == 0
    out = capsys.readouterr().out
    assert "predicted whole update" in out and "published (NeMo-RL nccl_reshard" in out and "7.65-9.94 s" in out


def test_sglang_meta_shapes_equal_analytic() -> None:
    """The real engine code (sglang's rank model on meta, via the adapter's shim) against the analytic model."""
    pytest.importorskip("sglang", reason="sglang (p2psync[sglang]) is not installed; run `tox -e conformance-sglang`")
    from p2psync.planner.engine import sglang_shapes
    from tests.helpers.sglang_models import config_dict, hf_config

    cases = [(config_dict(hf_config(kind)), tp, ep) for kind, tp, ep in
             [("qwen2", 2, 1), ("qwen3", 2, 1), ("qwen3_moe", 2, 2), ("qwen3_moe", 4, 2), ("deepseek_v3", 2, 2),
              ("deepseek_v3", 2, 1)]]
    # the presets themselves, at real width (sglang builds one layer of each kind on meta)
    # (not GLM-5: sglang 0.5.23 builds its sparse-attention indexer's rope on CPU only for DeepSeek-YaRN
    # scaling, which GLM-5 does not use; the planner models it analytically, saying so)
    cases += [(preset("GLM-4.5-Air"), 8, 8), (preset("Qwen3-235B-A22B"), 8, 4), (preset("Kimi-K2"), 8, 8),
              (preset("GLM-4.7-Flash"), 4, 4)]
    # an fp8 engine ([128, 128] blocks, which Kimi-K2's TP 8 split divides), as published
    fp8 = [(preset("Kimi-K2"), 8, 8, "fp8")]
    for cfg, tp, ep, dtype in [(cfg, tp, ep, "bf16") for cfg, tp, ep in cases] + fp8:
        kind = cfg["architectures"][0]
        real, analytic = sglang_shapes(cfg, tp, ep, dtype), analytic_shapes(cfg, tp, ep, dtype)
        assert real.source.startswith("shapes from sglang")
        if dtype == "fp8":
            assert any(p.dtype == "float8_e4m3fn" for ps in real.ranks[0].parts.values() for p in ps), kind
        for rank in range(tp):
            for part in set(real.ranks[rank].parts) | set(analytic.ranks[rank].parts):
                got = Counter((p.name, p.shape, p.dtype) for p in real.ranks[rank].parts.get(part, []))
                want = Counter((p.name, p.shape, p.dtype) for p in analytic.ranks[rank].parts.get(part, []))
                assert got == want, (kind, tp, ep, dtype, rank, part, got - want, want - got)


def test_fp8_shapes_sglang_does_not_build_are_analytic_saying_why() -> None:
    """GLM-4.5-Air at TP 8 splits its MoE rows into 1368, which [128, 128] blocks do not divide:
    sglang refuses the engine, and the planner says so and models it analytically."""
    pytest.importorskip("sglang", reason="sglang (p2psync[sglang]) is not installed; run `tox -e conformance-sglang`")
    from p2psync.planner.engine import shapes_for

    real = shapes_for(preset("Kimi-K2"), 8, 8, "fp8")
    assert real.source.startswith("shapes from sglang")
    refused = shapes_for(preset("GLM-4.5-Air"), 8, 8, "fp8")
    assert "sglang does not build this engine rank" in refused.source and "not divisible" in refused.source


def test_delta_wire_fraction_by_hand() -> None:
    """The encoding's sizes: 2-byte elements send 6 bytes per changed one as indices (3x the
    fraction), or a bit per element plus 2 bytes per changed one (1/16 + the fraction)."""
    from p2psync.planner.delta import wire_fraction

    assert wire_fraction(0.0, 2) == (0.0, "nothing")
    fraction, kind = wire_fraction(0.01, 2)
    assert kind == "index" and fraction == pytest.approx(0.03, rel=1e-3)
    fraction, kind = wire_fraction(0.05, 2)
    assert kind == "bitmap" and fraction == pytest.approx(1 / 16 + 0.05, rel=1e-3)
    assert wire_fraction(0.99, 2) == (1.0, "dense")
    assert wire_fraction(0.01, 1)[0] == pytest.approx(0.05, rel=1e-3)  # fp8: 5 bytes per changed 1-byte element
    with pytest.raises(ValueError, match="changed fraction"):
        wire_fraction(1.5, 2)


def test_cli_delta_fraction_adds_the_delta_way(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "Qwen3-30B-A3B", "--nodes", "2", "--train-tp", "4", "--train-ep", "8",
            "--engine-tp", "8", "--engine-ep", "8", "--shapes", "analytic", "--json"]
    assert main([*args, "--delta-fraction", "0.01", "--delta-compare-gbytes", "100"]) == 0
    ways = json.loads(capsys.readouterr().out)["update"]["ways"]
    full, delta = ways["p2psync"], ways["p2psync-delta"]
    assert delta["wire_s"] == pytest.approx(full["wire_s"] * delta["wire_fraction"])
    assert delta["wire_fraction"] == pytest.approx(0.03, rel=1e-3) and delta["gathers_s"] == full["gathers_s"]
    assert delta["compare_s"] > 0 and delta["apply_s"] > 0
    stages = [delta["gathers_s"], delta["production_s"] + delta["compare_s"], delta["wire_s"]]
    fixed = delta["pause_s"] + delta["finish_s"] + delta["post_load_s"] + delta["apply_s"]
    assert max(stages) < delta["total_s"] - fixed <= sum(stages)  # pipelined over the default 512 MiB buckets
    assert main(args[:-1] + ["--delta-fraction", "0.01"]) == 0
    assert "p2psync-delta" in capsys.readouterr().out


def test_delta_compare_counts_each_unit_once() -> None:
    """A sender serving two engines of one layout compares its bytes once, not per engine."""
    from p2psync.planner.delta import DeltaCosts, delta_way
    from p2psync.planner.update import Costs, whole_update

    c = Cluster(train_ranks=1, engines=2, engine_tp=1)
    p = predict(c, analytic_shapes(SMALL, 1, 1, "bf16"))
    one_engine = max(p.receiver_bytes.values())
    assert max(p.sender_bytes.values()) == 2 * one_engine
    p2p = whole_update(p, analytic_shapes(SMALL, 1, 1, "bf16"), Costs())["ways"]["p2psync"]
    way = delta_way(p, p2p, DeltaCosts(0.01, compare_gbytes=2.0), produce_gbytes=1000.0, bucket_bytes=1 << 20)
    assert way["compare_s"] == pytest.approx(3 * one_engine / 2e9)


def test_gloo_tree_broadcast_sends_as_a_binomial_tree_by_hand() -> None:
    """gloo's broadcast over a head and 4 engine ranks: member i sends to i + 2^k (2^k > i), so
    the head sends 3 copies (to 1, 2, 4) and member 1 one (to 3), as the cluster in a box's NIC
    counters measured (839.6 MB = 3 x 279.9 MB from trainer rank 0, 280.0 MB from the first
    engine rank); the ring (the chain) sends one copy from every member but the last."""
    shapes = analytic_shapes(SMALL, tp=2, ep=1, dtype="bf16")
    cluster = Cluster(train_ranks=4, engines=2, engine_tp=2, gpus_per_node=4, nics_per_node=4, nic_gbps=8.0,
                      latency_us=0.0)
    full = predict(cluster, shapes, "ring").stage_full_bytes[0]
    tree, ring = predict(cluster, shapes, "tree"), predict(cluster, shapes, "ring")
    assert tree.bcast_nic_send[cluster.trainer_nic(0)] == 3 * full
    # the head, and engine rank 0 of engine 0; every other NIC sends nothing
    assert sorted(n for n in tree.bcast_nic_send.values() if n) == [full, 3 * full]
    assert tree.bcast_nic_send[cluster.engine_nic(0, 0)] == full
    assert sorted(n for n in ring.bcast_nic_send.values() if n) == [full] * 4  # the head, three engine ranks relaying
    assert tree.broadcast_s == pytest.approx(3 * full / 1e9) and ring.broadcast_s == pytest.approx(full / 1e9)
