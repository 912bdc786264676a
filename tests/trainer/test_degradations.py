"""Nothing degrades silently: where an update takes a slower way than the session asked for,
its report says so in words (`UpdateReport.degraded`, also in `format()`) and the log says
it at warning level. The toy engine's ranks must still hold their own loader's bytes."""

from __future__ import annotations

import logging

import torch

from p2psync.core.types import SenderGroup
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import ShardSource, engine_rank, hf_model, toy_session


def tensors_of(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in hf_model(seed).state_dict().items()}


def assert_own_load(engines, sources):
    for rank, engine in enumerate(engines):
        expected = engine_rank(len(engines), rank, sources)[1]
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.view(torch.uint8), expected[name].view(torch.uint8)), (rank, name)


def test_a_sender_group_without_local_shards_says_everything_was_gathered(caplog):
    """Two sender ranks that describe no shards all-gather what each could have sent of its own
    (this process plays rank 0 of the two: its half of the units is what it sends)."""
    source = DictSource(tensors_of(0), SenderGroup("all", (0, 1), 0))
    with caplog.at_level(logging.WARNING), toy_session(source) as (session, engines):
        report = session.update("v1")
    assert any("'test-dict' describes no local shards" in note for note in report.degraded), report.degraded
    assert "degraded: gather-free" in report.format()
    assert any("describes no local shards" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_lone_sender_without_local_shards_is_not_degraded():
    """One sender rank holds every tensor whole: gathering moves nothing, so the default
    (gather-free where it can) has nothing to report."""
    with toy_session(DictSource(tensors_of(0))) as (session, engines):
        report = session.update("v1")
        assert_own_load(engines, tensors_of(0))
    assert report.ok and report.degraded == [], report.degraded
    assert session.stats().gather_free_bytes[0] == 0


def test_groups_gathered_instead_of_gather_free_are_named_with_why():
    sources = tensors_of(0)
    twice = {"layers.0.q.weight": ((0, sources["layers.0.q.weight"].numel()),) * 2}
    with toy_session(ShardSource(sources, twice), gather="auto") as (session, engines):
        report = session.update("v1")
        assert_own_load(engines, sources)
    assert report.ok
    # layer 0's fused qkv reads q, on each of the two engine ranks
    assert any("2 parameter group(s) over the engine ranks gathered instead (e.g. 'layers.0.qkv'): their HF "
               "tensors are not held exactly once" in n for n in report.degraded), report.degraded
    assert any("the engine's loader computes their bytes" in n for n in report.degraded), report.degraded


def test_a_full_gathering_session_reports_nothing_degraded():
    with toy_session(DictSource(tensors_of(0)), gather="always") as (session, engines):
        assert session.update("v1").degraded == []


def test_units_over_the_delta_budget_are_reported_sent_in_full():
    source = DictSource(tensors_of(0))
    with toy_session(source, delta={"memory_bytes": 1}) as (session, engines):
        session.update("v1")
        source.tensors.update(tensors_of(1))
        report = session.update("v2")
        assert_own_load(engines, source.tensors)
    assert report.ok and report.engines["toy-0"].delta_ranks == []
    assert any("do not fit the baselines' memory budget (1 bytes per rank) and were sent in full" in n
               for n in report.degraded), report.degraded


def test_a_failed_check_names_every_parameter_that_differs():
    from p2psync.conformance.faults import corrupting
    from p2psync.core.types import TargetId
    from p2psync.transports.samehost.transport import SameHostTransport

    transport = corrupting(SameHostTransport, TargetId("toy-0", 1))()
    source = DictSource(tensors_of(0))
    with toy_session(source, transport=transport, bucket_bytes=1) as (session, engines):
        assert session.update("v1").ok
        transport.armed = True
        report = session.update("v2")
    error = report.engines["toy-0"].error
    assert report.stale == ["toy-0"] and "rank 1" in error, report.format()
    # one wrong byte per write job: every group this update wrote to rank 1 lands one
    named = [n for n in ("embed", "layers.0.qkv", "layers.0.o", "layers.1.qkv", "layers.1.o") if n in error]
    assert len(named) >= 3, error
    assert "more parameter(s) differ" in error, error
