"""The conformance table (p2psync/conformance/table.py): what each environment was expected to
run, and what fails the matrix. Environment py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2psync.conformance.table import Outcome, build, expected_rows, main

TORCH = ("fsdp2", "torch", "mooncake", "cpu", "-")
SGLANG = ("fsdp2", "sglang", "mooncake", "cpu", "-")
SGLANG_NIXL = ("fsdp2", "sglang", "nixl", "cpu", "-")


def results(env: str, rows: list[tuple[tuple[str, ...], str, str]], exitstatus: int = 0, **extra) -> dict:
    return {"env": env, "exitstatus": exitstatus, "rows": [[*k, s, r] for k, s, r in rows], **extra}


def test_a_pattern_stands_for_every_combination_of_its_values():
    rows = expected_rows([{"trainer": ["fsdp2", "megatron"], "engine": "torch", "transport": ["a", "b"]},
                          {"engine": "torch"}])
    assert rows == [
        ("fsdp2", "torch", "a", "cpu", "-"), ("fsdp2", "torch", "b", "cpu", "-"),
        ("megatron", "torch", "a", "cpu", "-"), ("megatron", "torch", "b", "cpu", "-"),
        ("-", "torch", "-", "cpu", "-"),
    ]
    with pytest.raises(ValueError, match="unknown kinds"):
        expected_rows([{"engines": "torch"}])


def test_everything_expected_and_passed_is_a_green_matrix():
    matrix = build({"t": results("t", [(TORCH, "passed", "")])}, {"t": [TORCH]})
    assert matrix.ok and matrix.rows == {TORCH: ("t", Outcome("passed"))}


def test_a_skip_with_its_reason_is_shown_and_does_not_fail_alone():
    matrix = build(
        {"s": results("s", [(SGLANG, "passed", ""), (SGLANG_NIXL, "skipped", "no nixl")])},
        {"s": [SGLANG, SGLANG_NIXL]},
    )
    assert matrix.rows[SGLANG_NIXL] == ("s", Outcome("skipped", "no nixl"))
    assert matrix.problems == ["transport nixl: no combination passed (no nixl)"]  # nixl passed nowhere


def test_an_environment_that_produced_nothing_fails_and_its_rows_show_missing():
    matrix = build({"t": results("t", [(TORCH, "passed", "")])}, {"t": [TORCH], "s": [SGLANG]})
    assert matrix.rows[SGLANG] == ("s", Outcome("missing", "s produced no results"))
    assert "environment s produced no results" in matrix.problems
    assert any(p.startswith("engine sglang: no combination passed") for p in matrix.problems)


def test_an_engine_skipped_everywhere_fails_the_matrix_saying_why():
    why = "engine target sglang cannot import sglang: ModuleNotFoundError: No module named 'sglang'"
    matrix = build(
        {"t": results("t", [(TORCH, "passed", "")]),
         "s": results("s", [(SGLANG, "skipped", why), (SGLANG_NIXL, "skipped", why)])},
        {"t": [TORCH], "s": [SGLANG, SGLANG_NIXL]},
    )
    assert not matrix.ok
    assert f"engine sglang: no combination passed ({why})" in matrix.problems


def test_an_expected_row_that_did_not_run_is_missing_with_the_collection_skips():
    matrix = build(
        {"s": results("s", [(SGLANG, "passed", "")], collect_skips=["tests/x.py skipped: no sglang"])},
        {"s": [SGLANG, SGLANG_NIXL]},
    )
    assert matrix.rows[SGLANG_NIXL] == ("s", Outcome("missing", "tests/x.py skipped: no sglang"))
    assert any("fsdp2 x sglang x nixl x cpu: missing" in p for p in matrix.problems)


def test_a_failure_or_a_failed_pytest_run_fails_the_matrix():
    failed = build({"t": results("t", [(TORCH, "failed", "")])}, {"t": [TORCH]})
    assert "t: fsdp2 x torch x mooncake x cpu: failed" in failed.problems
    crashed = build({"t": results("t", [(TORCH, "passed", "")], exitstatus=1)}, {"t": [TORCH]})
    assert crashed.problems == ["environment t: pytest exited with status 1"]


def test_any_failure_or_skip_among_a_combination_s_tests_wins():
    matrix = build({"t": results("t", [(TORCH, "passed", ""), (TORCH, "skipped", "x"), (TORCH, "passed", "")])},
                   {"t": [TORCH]})
    assert matrix.rows[TORCH][1] == Outcome("skipped", "x")


def test_main_prints_the_table_and_exits_by_the_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    expect = tmp_path / "expected.json"
    expect.write_text(json.dumps({"t": [{"trainer": "fsdp2", "engine": "torch", "transport": "mooncake"}],
                                  "s": [{"trainer": "fsdp2", "engine": "sglang", "transport": "mooncake"}]}))
    folder = tmp_path / "results"
    assert main(["--clear", str(folder)]) == 0
    (folder / "t.json").write_text(json.dumps(results("t", [(TORCH, "passed", "")])))
    assert main([str(folder), "--expect", str(expect), "--envs", "t"]) == 0
    assert "fsdp2    torch   mooncake   cpu     -    t            passed" in capsys.readouterr().out
    assert main([str(folder), "--expect", str(expect)]) == 1  # s expected, nothing from it
    assert "FAILED: environment s produced no results" in capsys.readouterr().err
