"""Pause modes: names, aliases, and how an engine's mode is chosen."""

from __future__ import annotations

import pytest

from p2psync import OptionsError, SessionOptions
from p2psync.core.pause import PAUSE_MODES, choose, pause_mode


def test_modes_and_vllms_name_for_in_place():
    assert PAUSE_MODES == ("abort", "retract", "in_place", "wait")
    assert [pause_mode(m) for m in PAUSE_MODES] == list(PAUSE_MODES)
    assert pause_mode("keep") == "in_place"
    with pytest.raises(OptionsError, match="pause mode 'freeze' is not one of abort, retract, in_place, wait, keep"):
        pause_mode("freeze")


def test_the_default_is_the_engines_first_mode_that_aborts_nothing():
    assert choose(None, ("abort", "retract", "in_place"), "s") == "retract"
    assert choose(None, ("wait", "abort"), "t") == "wait"
    assert choose(None, ("abort",), "old") == "abort"  # an engine that has nothing else


def test_a_mode_the_engine_lacks_is_refused_naming_the_engine_and_its_modes():
    assert choose("abort", ("wait", "abort"), "t") == "abort"
    with pytest.raises(OptionsError, match="engine t cannot pause in mode 'retract'; it has wait, abort"):
        choose("retract", ("wait", "abort"), "t")


def test_session_options_take_a_mode_or_its_alias_and_refuse_others():
    assert SessionOptions().pause is None and SessionOptions().flush_cache is True
    assert SessionOptions(pause="keep").pause == "in_place"
    assert SessionOptions.of({"pause": "wait", "flush_cache": False}).flush_cache is False
    with pytest.raises(OptionsError, match="option pause='freeze' is not"):
        SessionOptions.of({"pause": "freeze"})


def test_version_spans_read_from_an_sglang_response():
    from p2psync.adapters.sglang import VersionSpan, version_spans

    across = {"weight_versions": [{"version": "v1", "start": 0, "end": 5}, {"version": "v2", "start": 5, "end": 9}],
              "weight_version": "v2", "completion_tokens": 9}
    assert version_spans(across) == [VersionSpan("v1", 0, 5), VersionSpan("v2", 5, 9)]
    assert version_spans({"weight_version": "v3", "completion_tokens": 4}) == [VersionSpan("v3", 0, 4)]
    with pytest.raises(ValueError, match="names no weight version"):
        version_spans({"completion_tokens": 4})
