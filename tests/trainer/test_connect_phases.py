"""A connect says where its time went (issue #49): `ConnectReport.phase_seconds`, phase by phase.
The oracle: a delay the test puts into one phase (the layouts') shows up in that phase alone, and
the phases add up to no more than the connect's time on the test's own clock."""

from __future__ import annotations

import time

from p2psync.core.report import CONNECT_PHASES, format_phases
from p2psync.trainer.layouts import LayoutCache
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import hf_model, toy_session
from tests.layouts.test_add_an_engine import state_of

DELAY = 0.5


def test_a_slow_phase_is_named_in_the_connects_report(monkeypatch):
    with toy_session(DictSource(state_of(hf_model(1))), tp=2) as (session, _):
        layouts = LayoutCache.layouts

        def slow_layouts(self, *args, **kwargs):
            time.sleep(DELAY)
            return layouts(self, *args, **kwargs)

        monkeypatch.setattr(LayoutCache, "layouts", slow_layouts)
        started = time.monotonic()
        report = session.connect(["toy-0"])
        took = time.monotonic() - started
    phases = report.phase_seconds
    assert list(phases) == list(CONNECT_PHASES), phases
    assert phases["layouts"] >= DELAY and max(phases, key=phases.__getitem__) == "layouts", phases
    assert sum(phases.values()) - phases["layouts"] < DELAY, phases
    assert sum(phases.values()) <= took, (phases, took)
    assert f"layouts {phases['layouts']:.2f}" in format_phases(phases)
