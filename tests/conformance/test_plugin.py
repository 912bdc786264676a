"""The conformance pytest plugin: combinations from classes, markers and parameters, selection
by an environment's expectations, skips and missing rows in its results. Environment py."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest_plugins = ("pytester",)

SUITE = '''
import pytest

class TestEngine:
    conformance = {"engine": "torch"}

    def test_ok(self):
        pass

@pytest.mark.parametrize("transport", ["a", "b", "c"])
class TestRoundTrip:
    conformance = {"trainer": "fsdp2", "engine": "torch"}

    def test_bytes(self, transport):
        if transport == "b":
            pytest.skip("b is not installed")
        assert transport != "c", "c wrote a wrong byte"

@pytest.mark.conformance(trainer="fsdp2", engine="torch", transport="a", via="verl")
def test_through_verl():
    pass

def test_outside_the_matrix():
    pass
'''

EXPECTED = {
    "env": [
        {"engine": "torch"},
        {"trainer": "fsdp2", "engine": "torch", "transport": ["a", "b", "c", "d"]},
        {"trainer": "fsdp2", "engine": "torch", "transport": "a", "via": "verl"},
    ],
    "other": [{"engine": "sglang"}],
}


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    (pytester.path / "expected.json").write_text(json.dumps(EXPECTED))
    pytester.makeini("[pytest]\np2psync_expectations = expected.json\n")
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict]:
    out = pytester.runpytest("--p2psync-results", "results.json", *args)
    return out, json.loads((pytester.path / "results.json").read_text())


def rows(results: dict) -> dict[tuple[str, ...], tuple[str, str]]:
    return {tuple(r[:5]): (r[5], r[6]) for r in results["rows"]}


XDIST = pytest.param(["-n", "2"], marks=pytest.mark.skipif(
    not importlib.util.find_spec("xdist"), reason="pytest-xdist is not installed"), id="xdist")


@pytest.mark.parametrize("workers", [pytest.param([], id="one-process"), XDIST])
def test_results_name_each_combination_its_outcome_and_the_missing_ones(suite: pytest.Pytester, workers: list[str]):
    """Also under pytest-xdist, where workers run the tests and the controller writes the table."""
    out, results = run(suite, "--p2psync-env", "env", *workers)
    assert results["env"] == "env" and results["exitstatus"] == 1  # transport c failed
    assert rows(results) == {
        ("-", "torch", "-", "cpu", "-"): ("passed", ""),
        ("fsdp2", "torch", "a", "cpu", "-"): ("passed", ""),
        ("fsdp2", "torch", "b", "cpu", "-"): ("skipped", "b is not installed"),
        ("fsdp2", "torch", "c", "cpu", "-"): ("failed", ""),
        ("fsdp2", "torch", "d", "cpu", "-"): ("missing", "not collected or deselected"),
        ("fsdp2", "torch", "a", "cpu", "verl"): ("passed", ""),
    }
    out.assert_outcomes(passed=4, failed=1, skipped=1)  # the test outside the matrix runs too
    out.stdout.fnmatch_lines(["*fsdp2*torch*d*cpu*env*missing (not collected or deselected)"])


def test_an_environment_runs_only_what_it_expects(suite: pytest.Pytester):
    out, results = run(suite, "--p2psync-env", "other")
    assert rows(results) == {("-", "sglang", "-", "cpu", "-"): ("missing", "not collected or deselected")}
    out.assert_outcomes(passed=1, deselected=5)


def test_without_an_environment_everything_runs_and_nothing_is_missing(suite: pytest.Pytester):
    out, results = run(suite, "--p2psync-transport", "a")
    assert results["env"] == "results"  # named after the file
    assert set(rows(results)) == {("-", "torch", "-", "cpu", "-"), ("fsdp2", "torch", "a", "cpu", "-"),
                                  ("fsdp2", "torch", "a", "cpu", "verl")}
    out.assert_outcomes(passed=4, deselected=2)


def test_a_module_skipped_at_import_explains_its_missing_rows(pytester: pytest.Pytester):
    pytester.makepyfile(test_gone='import pytest\npytest.importorskip("no_such_engine", reason="no engine here")\n')
    (pytester.path / "expected.json").write_text(json.dumps({"env": [{"engine": "gone"}]}))
    pytester.makeini("[pytest]\np2psync_expectations = expected.json\n")
    _, results = run(pytester, "--p2psync-env", "env")
    assert rows(results) == {("-", "gone", "-", "cpu", "-"): ("missing", "test_gone.py skipped: no engine here")}


def test_a_module_that_fails_to_import_explains_its_missing_rows(pytester: pytest.Pytester):
    pytester.makepyfile(test_broken='raise ImportError("sglang is broken here")\n')
    (pytester.path / "expected.json").write_text(json.dumps({"env": [{"engine": "sglang"}]}))
    pytester.makeini("[pytest]\np2psync_expectations = expected.json\n")
    _, results = run(pytester, "--p2psync-env", "env")
    assert results["exitstatus"] == pytest.ExitCode.INTERRUPTED
    assert rows(results) == {
        ("-", "sglang", "-", "cpu", "-"): ("missing", "test_broken.py failed to import: ImportError: sglang is broken here")
    }


def test_an_unknown_environment_is_a_usage_error(suite: pytest.Pytester):
    out = suite.runpytest("--p2psync-env", "nowhere")
    assert out.ret == pytest.ExitCode.USAGE_ERROR
    out.stderr.fnmatch_lines(["*has no environment 'nowhere'*"])
