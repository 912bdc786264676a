"""`p2psync bench --lora`: the bytes each way moves per engine rank, against PEFT's and torch's own
counts of the adapter and the model, and the verification."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")


def test_the_lora_bench_moves_the_adapters_bytes_against_the_whole_models_and_verifies():
    from peft import get_peft_model_state_dict

    from p2psync.bench import BenchOptions
    from p2psync.bench.lora import LORA_RANK, format_lora, run_lora_bench
    from p2psync.demo import CONFIGS
    from p2psync.worlds import ModelSpec
    from p2psync.worlds.lora import with_adapter

    result = run_lora_bench(BenchOptions(size="tiny", updates=1, warmup=0))
    adapter = sum(t.nbytes for t in get_peft_model_state_dict(with_adapter(CONFIGS["tiny"], seed=0, rank=LORA_RANK)).values())
    model = sum(t.nbytes for t in ModelSpec("qwen3", CONFIGS["tiny"]).build(seed=0).state_dict().values())
    assert result["rank_bytes"] == {"full": model, "lora": adapter} and result["verified"]
    lines = format_lora(result).splitlines()
    assert [line.split()[:2] for line in lines[2:4]] == [["full", f"{model:,}"], ["lora", f"{adapter:,}"]]
    assert "; verified" in lines[4]


def test_the_lora_bench_runs_alone(capsys):
    from p2psync.cli import main

    assert main(["bench", "--lora", "--delta"]) == 2
    assert "--lora runs alone, on a torch engine (--delta given)" in capsys.readouterr().err
