"""What a Session refuses before an update starts, with the toy engine's ranks as oracle:
a second call from another thread while one runs (the running one is not disturbed), and
a version label that would name two sets of weights (nothing is written), in the session or
on an engine that served it to another session."""

from __future__ import annotations

import threading

import pytest
import torch

from p2psync.core.errors import ConcurrentCallError, VersionError
from p2psync.trainer.guards import VersionLabels
from p2psync.trainer.session import Session
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import engine_rank, hf_model, toy_session


def own_load_of(engines, sources):
    return [engine_rank(len(engines), rank, sources)[1] for rank in range(len(engines))]


def assert_holds(engines, expected, when):
    for rank, engine in enumerate(engines):
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.view(torch.uint8), expected[rank][name].view(torch.uint8)), (when, rank, name)


@pytest.mark.parametrize(
    ("labels", "refused"),
    [
        (["v1", "v2", "v1"], "already used by update 1"),
        (["v9", "v10", "v3"], "orders before the latest update's 'v10'"),
        (["step-2-of-8", "step-1-of-8"], "orders before"),
        (["v1", ""], "non-empty string"),
    ],
)
def test_a_label_naming_other_weights_is_refused(labels, refused):
    versions = VersionLabels()
    for label in labels[:-1]:
        versions.check(label, rollback=False)
        versions.record(label)
    with pytest.raises(VersionError, match=refused):
        versions.check(labels[-1], rollback=False)


def test_labels_that_go_forward_or_read_differently_pass_and_a_rollback_is_allowed():
    versions = VersionLabels()
    for label in ["v9", "v10", "warm-up", "step-1", "v11"]:
        versions.check(label, rollback=False)
        versions.record(label)
    versions.check("v9", rollback=True)


def test_a_reused_version_is_refused_before_anything_is_written():
    trainer = hf_model(0)
    first = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    with toy_session(DictSource(first)) as (session, engines):
        assert session.update("v1").ok
        expected = own_load_of(engines, first)
        changed = {n: t + 1 for n, t in first.items()}
        session.source.tensors.update(changed)
        with pytest.raises(VersionError, match="'v1' was already used"):
            session.update("v1")
        assert_holds(engines, expected, "after the refused update")  # nothing written
        assert session.update("v1-again", rollback=False).ok
        assert_holds(engines, own_load_of(engines, changed), "after the next update")


def test_a_label_an_engine_served_is_refused_to_a_new_session_unless_a_rollback_brings_its_weights_back():
    """A restarted trainer (a new Session) labels other weights 'v1', which the engine served:
    refused on every rank before anything is written; as a rollback with other weights, the
    engine does not serve them; a rollback to the weights 'v1' named is served."""
    first = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    changed = {n: t + 1 for n, t in first.items()}
    with toy_session(DictSource(first)) as (session, engines):
        assert session.update("v1").ok
        v1 = own_load_of(engines, first)
        with Session(source=DictSource(changed), rendezvous=session.rendezvous, transport="samehost",
                     check=True) as restarted:
            restarted.connect(["toy-0"])
            with pytest.raises(VersionError, match="engine 'toy-0' rank 0: it served version 'v1' before"):
                restarted.update("v1")
            assert_holds(engines, v1, "after the refused label")  # nothing written
            report = restarted.update("v1", rollback=True)
            assert report.stale == ["toy-0"], report.format()
            assert "version 'v1' named other weights when this rank served it before" in report.engines["toy-0"].error
            restarted.source.tensors.update(first)
            assert restarted.update("v1", rollback=True).ok
            assert_holds(engines, v1, "after the rollback")


def test_a_second_call_while_an_update_runs_is_refused_and_the_first_is_undisturbed():
    trainer = hf_model(0)
    tensors = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    with toy_session(DictSource(tensors)) as (session, engines):
        single = session.update("v1")
        inside, release = threading.Event(), threading.Event()
        reports = []

        def hold(done: int, total: int) -> None:
            inside.set()
            assert release.wait(30)

        thread = threading.Thread(target=lambda: reports.append(session.update("v2", progress=hold)))
        thread.start()
        try:
            assert inside.wait(30), "the first update never reached its progress callback"
            with pytest.raises(ConcurrentCallError, match="update called while update is running"):
                session.update("v3")
            with pytest.raises(ConcurrentCallError, match="connect called while update is running"):
                session.connect(["toy-0"])
        finally:
            release.set()
            thread.join(60)
        (report,) = reports
        assert report.ok and report.engines["toy-0"].bytes == single.engines["toy-0"].bytes
        assert_holds(engines, own_load_of(engines, tensors), "after the undisturbed update")
        assert session.update("v3").ok  # the refused label was never used
