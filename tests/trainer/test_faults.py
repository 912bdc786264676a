"""Faults: a killed or stuck engine is reported by name, the others complete and
resume, a report that calls an engine stale is the truth, and nothing leaks across many
updates."""

from __future__ import annotations

import gc
import re
import threading
import time

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import small_model, wait_for  # noqa: E402
from tests.helpers.steps import after_step  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.conformance.faults import corrupting  # noqa: E402
from p2psync.core.control import post  # noqa: E402
from p2psync.core.errors import TransferError, TransferTimeout  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.core.types import TargetId  # noqa: E402
from p2psync.engine.client import EndpointControl  # noqa: E402
from p2psync.transports.mooncake.transport import MooncakePeer, MooncakeTransport  # noqa: E402

TIMEOUT = 3.0
MARGIN = 5.0


def session_for(engine_group, model, transport="mooncake", **kwargs) -> Session:
    kwargs.setdefault("bucket_bytes", 1)  # one bucket per parameter: an update has several steps
    kwargs.setdefault("transfer_timeout", TIMEOUT)
    kwargs.setdefault("check", True)
    return Session(source=FSDP2Source(model), transport=transport, rendezvous=engine_group.rendezvous, **kwargs)


def info(session: Session, engine: str) -> dict:
    table = session.tables[engine][0]
    return post(table.control_url, "info", token=session.token, timeout=10)


def serving(session: Session, engine: str) -> tuple[str | None, bool]:
    """The version engine `engine` holds, and whether it serves it."""
    status = info(session, engine)
    return status["version"], status["serving"]


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))


def test_killed_engine_is_stale_and_the_other_resumes(engine_group):
    engine_group.start("a")
    engine_group.start("b")
    model = small_model(0)
    with session_for(engine_group, model) as session:
        session.connect(["a", "b"])
        assert session.stats().bucket_count > 2

        start = time.monotonic()
        report = session.update("v1", progress=after_step(1, lambda: engine_group.kill("b")))
        elapsed = time.monotonic() - start

        assert report.stale == ["b"], report.format()
        assert "'b'" in report.engines["b"].error
        assert report.engines["a"].ok and report.engines["a"].checked
        assert elapsed < TIMEOUT + MARGIN
        assert serving(session, "a") == ("v1", True)


class FaultyTransport(MooncakeTransport):
    """Mooncake whose writes to engine 'b' fail at once (`failing`) or never
    complete (`stuck`: the peer is silent until the write's timeout)."""

    failing = False
    stuck = False

    def open(self, table):
        peer = super().open(table)
        if table.engine_id != "b":
            return peer
        transport = self

        class FaultyPeer(MooncakePeer):
            def write(self, batch, *, timeout):
                if transport.failing:
                    raise TransferError(f"injected failure to {self.session}")
                if transport.stuck:
                    time.sleep(timeout)
                    raise TransferTimeout(f"injected: write to {self.session} not done after {timeout:.1f} s")
                super().write(batch, timeout=timeout)

        return FaultyPeer(peer.engine, peer.session)


def test_stuck_engine_is_stale_and_delays_the_other_by_at_most_one_timeout(engine_group):
    engine_group.start("a")
    engine_group.start("b")
    model = small_model(0)
    transport = FaultyTransport()
    with session_for(engine_group, model, transport=transport) as session:
        session.connect(["a", "b"])
        assert session.stats().bucket_count > 2

        start = time.monotonic()
        report = session.update("v1", progress=after_step(1, lambda: setattr(transport, "stuck", True)))
        elapsed = time.monotonic() - start

        assert report.stale == ["b"], report.format()
        assert "'b'" in report.engines["b"].error and f"{TIMEOUT:.1f} s" in report.engines["b"].error
        assert report.engines["a"].ok and report.engines["a"].checked
        assert elapsed < TIMEOUT + MARGIN
        # Still paused for the update: never resumed with mixed weights.
        assert (info(session, "b")["updating"], info(session, "b")["serving"]) == ("v1", False)
        assert serving(session, "a") == ("v1", True)


def test_a_rank_corrupted_after_its_writes_is_stale_by_name_and_stays_paused(engine_group):
    """One wrong byte lands on engine b's rank after p2psync's writes, before the digest check."""
    engine_group.start("a")
    engine_group.start("b")
    model = small_model(0)
    transport = corrupting(MooncakeTransport, TargetId("b", 0))()
    with session_for(engine_group, model, transport=transport) as session:
        session.connect(["a", "b"])
        assert session.update("v1").ok

        transport.armed = True
        perturb(model, 1)
        report = session.update("v2")
        assert report.stale == ["b"], report.format()
        assert re.search(r"engine 'b' rank 0 parameter '[\w.]+': digest mismatch after write", report.engines["b"].error)
        assert report.engines["a"].ok and report.engines["a"].checked
        # Still paused for the update, on no version it serves: never resumed with a wrong byte.
        assert (info(session, "b")["updating"], info(session, "b")["serving"]) == ("v2", False)
        assert serving(session, "a") == ("v2", True)

        transport.armed = False
        perturb(model, 2)
        assert session.update("v3").ok  # the next update repairs it
        assert serving(session, "b") == ("v3", True)


def test_a_finish_that_got_no_answer_leaves_no_engine_serving_what_the_report_calls_stale(engine_group, monkeypatch):
    """Engine b stops (SIGSTOP) once its writes landed, as its finish is called, and goes on
    after the report: the finish it receives late must not have it serve v1 while the report
    calls it stale (#46: 8 of 156 updates under random stops did)."""
    engine_group.start("a")
    engine_group.start("b")
    finish = EndpointControl.finish

    def stop_b_first(self: EndpointControl, version: str) -> None:
        if self.tables[0].engine_id == "b":
            engine_group.freeze("b")
        finish(self, version)

    monkeypatch.setattr(EndpointControl, "finish", stop_b_first)
    with session_for(engine_group, small_model(0)) as session:
        session.connect(["a", "b"])
        report = session.update("v1")
        engine_group.thaw("b")
        assert report.stale == ["b"], report.format()
        assert serving(session, "a") == ("v1", True)
        stale = wait_for(lambda: info(session, "b")["stale"], 2 * TIMEOUT, "b giving the update up")
        assert stale.startswith("update 'v1' given up by the trainer"), stale
        assert serving(session, "b")[1] is False
        assert report.engines["b"].error.startswith("finish got no answer: engine 'b' rank 0: finish at ")


def test_an_engine_that_withdrew_its_table_is_named_withdrawn_with_what_to_do(engine_group):
    """Engine b shuts down cleanly after the connect, as an unloaded LoRA slot does (its table
    withdrawn, its endpoint closed): the update says so and what to do, not "Connection refused"."""
    engine_group.start("a")
    engine_group.start("b")
    with session_for(engine_group, small_model(0)) as session:
        session.connect(["a", "b"])
        engine_group.stop("b")
        report = session.update("v1")
        assert report.stale == ["b"], report.format()
        assert report.engines["b"].error == (
            "pause failed: its table was withdrawn (it shut down, or its LoRA slot was unloaded); connect again "
            "without it"
        )
        assert serving(session, "a") == ("v1", True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_fifty_updates_with_failures_leak_nothing(engine_group):
    engine_group.width = 64
    engine_group.start("a")
    engine_group.start("b")
    model = small_model(0, width=64)
    transport = FaultyTransport()
    with session_for(engine_group, model, transport=transport) as session:
        session.connect(["a", "b"])
        session.update("warm-up")
        gc.collect()
        threads, registered, rss = threading.active_count(), len(transport._registered), rss_bytes()
        for step in range(50):
            transport.failing = step % 3 == 0
            perturb(model, step)
            report = session.update(f"v{step}")
            assert report.engines["a"].ok, report.format()
            assert report.engines["b"].ok is not transport.failing, report.format()
        gc.collect()
        assert threading.active_count() == threads
        assert len(transport._registered) == registered
        assert rss_bytes() - rss < 64 << 20
        assert info(session, "b")["version"] == "v49"


def test_two_hundred_verified_updates_without_a_mismatch(engine_group):
    engine_group.start("a")
    model = small_model(0)
    with session_for(engine_group, model, bucket_bytes=16 << 10) as session:
        session.connect(["a"])
        for step in range(200):
            perturb(model, step)
            report = session.update(f"v{step}")
            assert report.ok and report.engines["a"].checked, report.format()
