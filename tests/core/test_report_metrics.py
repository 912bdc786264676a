"""`UpdateReport.metrics()` (issue #47): an update as one flat dict for the framework's logger.
The oracle: the model's own parameter bytes (torch's count) and the report's own fields."""

from __future__ import annotations

import pytest

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.trainer.session import Session
from tests.helpers.engines import engines, small_model

pytest.importorskip("mooncake.engine", reason="the engines are written over Mooncake (extra 'mooncake')")


def test_metrics_carry_bytes_per_engine_phases_and_outcome():
    model = small_model(0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with engines() as group:
        group.start("a")
        group.start("b")
        with Session(source=FSDP2Source(model), rendezvous=group.rendezvous, transport="mooncake") as session:
            session.connect(["a", "b"])
            report = session.update("v1")
    metrics = report.metrics()
    assert all(isinstance(v, float) for v in metrics.values()), metrics
    assert metrics["p2psync/bytes"] == 2 * model_bytes
    for engine in ("a", "b"):
        assert metrics[f"p2psync/engine/{engine}/bytes"] == model_bytes
        assert metrics[f"p2psync/engine/{engine}/ok"] == 1.0
    assert (metrics["p2psync/engines_ok"], metrics["p2psync/engines_stale"]) == (2.0, 0.0)
    phases = {k: v for k, v in metrics.items() if k.startswith("p2psync/phase/")}
    assert {"p2psync/phase/pause_seconds", "p2psync/phase/finish_seconds"} <= set(phases), phases
    # the finish phase also holds the report's broadcast to the other trainer ranks, after the update's seconds end
    before_finish = sum(v for k, v in phases.items() if k != "p2psync/phase/finish_seconds")
    assert 0 < before_finish <= metrics["p2psync/seconds"] * 1.05 + 0.05, (phases, metrics["p2psync/seconds"])
    assert metrics["p2psync/gbps"] == pytest.approx(2 * model_bytes / report.seconds / 1e9)
    assert set(report.metrics(prefix="sync/")) == {k.replace("p2psync/", "sync/", 1) for k in metrics}
