"""Pause modes on p2psync's own endpoint (a torch engine with a route of its own) and in a session:
"wait" drains the requests in flight before the update, "abort" throws their answers away, the
hooks get the mode, an engine lacking the mode asked refuses before anything is paused."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from p2psync import ConnectError, OptionsError, Rendezvous, Session
from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.adapters.torch import serve
from p2psync.core.control import post
from p2psync.core.errors import ControlError
from p2psync.engine.endpoint import EndpointControl, EngineEndpoint, EngineHooks
from tests.helpers.engines import RecordingTransport, engines, small_model, wait_for


class SlowRoute:
    """A `generate` route whose calls run until the test lets them finish: a request in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(10), "the test never let the request finish"
        return {"tokens": [7, 8]}


@contextmanager
def endpoint_with(hooks: EngineHooks) -> Iterator[tuple[EngineEndpoint, EndpointControl, Rendezvous]]:
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="modes", is_server=True, timeout=5)
    endpoint = serve(small_model(1), engine_id="e", rendezvous=rendezvous, transport=RecordingTransport(),
                     hooks=hooks, version="v0")
    try:
        yield endpoint, EndpointControl(rendezvous.read_engine("e"), timeout=10, token=rendezvous.token()), rendezvous
    finally:
        endpoint.close()


def in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `call()` on a thread; its answer or error lands in the returned dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["answer"] = call()
        except Exception as exc:  # the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def request_in_flight(
    endpoint: EngineEndpoint, rendezvous: Rendezvous, route: SlowRoute
) -> tuple[threading.Thread, dict[str, Any]]:
    """A `generate` call that has entered `route` and runs until the test releases it."""
    request, answer = in_thread(lambda: post(endpoint.url, "generate", token=rendezvous.token(), timeout=10))
    assert route.entered.wait(5)
    return request, answer


def test_wait_drains_the_request_in_flight_before_the_engine_pauses():
    route, paused = SlowRoute(), []
    hooks = EngineHooks(pause=paused.append, routes={"generate": route})
    with endpoint_with(hooks) as (endpoint, control, rendezvous):
        request, answer = request_in_flight(endpoint, rendezvous, route)
        pausing, paused_answer = in_thread(lambda: control.pause("v1", 30, "wait"))
        wait_for(lambda: endpoint.state.updating == "v1", 5, "the pause admitting no new request")
        with pytest.raises(ControlError, match="is not serving: it is being updated to version 'v1'"):
            post(endpoint.url, "generate", token=rendezvous.token(), timeout=5)
        pausing.join(0.5)
        assert pausing.is_alive() and paused == [], "the pause returned with a request still in flight"
        route.release.set()
        request.join(5)
        pausing.join(5)
        assert answer == {"answer": {"tokens": [7, 8]}}  # finished on the old weights, nothing lost
        assert "error" not in paused_answer and paused == ["wait"]
        control.finish("v1")
        assert endpoint.version == "v1"


def test_a_drain_longer_than_the_trainers_call_refuses_the_pause_and_the_engine_stays_out_of_serving():
    route = SlowRoute()
    with endpoint_with(EngineHooks(routes={"generate": route})) as (endpoint, _, rendezvous):
        impatient = EndpointControl(rendezvous.read_engine("e"), timeout=1, token=rendezvous.token())
        request, answer = request_in_flight(endpoint, rendezvous, route)
        with pytest.raises(ControlError, match="1 request.s. still in flight after 0.9 s of draining"):
            impatient.pause("v1", 30, "wait")
        assert not endpoint.state.serving and endpoint.state.updating == "v1"
        route.release.set()
        request.join(5)
        assert answer == {"answer": {"tokens": [7, 8]}}


def test_abort_answers_the_request_in_flight_with_the_reason_and_throws_its_result_away():
    route, paused = SlowRoute(), []
    hooks = EngineHooks(pause=paused.append, routes={"generate": route})
    with endpoint_with(hooks) as (endpoint, control, rendezvous):
        request, answer = request_in_flight(endpoint, rendezvous, route)
        control.pause("v1", 30, "abort")  # returns at once
        assert paused == ["abort"]
        route.release.set()
        request.join(5)
        assert "answer" not in answer, answer
        assert "503" in str(answer["error"])
        assert "engine 'e' rank 0 aborted this request: it is being updated to version 'v1'" in str(answer["error"])
        control.finish("v1")
        assert post(endpoint.url, "generate", token=rendezvous.token(), timeout=5) == {"tokens": [7, 8]}


def test_a_mode_the_hooks_do_not_declare_is_refused_and_the_engine_keeps_serving():
    hooks = EngineHooks(routes={"generate": lambda body: {"tokens": [1]}})
    with endpoint_with(hooks) as (endpoint, control, rendezvous):
        assert control.pause_modes() == ("wait", "abort")
        with pytest.raises(ControlError, match="engine 'e' rank 0 cannot pause in mode 'in_place'; it has wait, abort"):
            control.pause("v1", 30, "in_place")
        assert endpoint.state.serving and endpoint.version == "v0"


def test_modes_a_hook_carries_out_itself_reach_it_and_the_cache_is_kept_when_asked():
    paused, flushed = [], []
    hooks = EngineHooks(pause=paused.append, flush_cache=lambda: flushed.append(True),
                        pause_modes=("in_place", "retract", "wait", "abort"))
    with endpoint_with(hooks) as (endpoint, control, rendezvous):
        assert control.pause_modes() == ("in_place", "retract", "wait", "abort")
        assert post(endpoint.url, "info", token=rendezvous.token(), timeout=5)["pause_modes"] == [
            "in_place", "retract", "wait", "abort"
        ]
        control.pause("v1", 30, "in_place", flush_cache=False)
        control.finish("v1")
        control.pause("v2", 30, "retract")
        control.finish("v2")
        assert paused == ["in_place", "retract"] and flushed == [True]


def test_hooks_naming_no_known_mode_are_refused_at_start():
    with pytest.raises(ValueError, match="hooks.pause_modes .'freeze',. must name one or more pause modes"):
        EngineEndpoint(
            engine="torch", engine_id="e", rank=0, world_size=1, params={}, layout_key={},
            transport=RecordingTransport(), rendezvous=None, hooks=EngineHooks(pause_modes=("freeze",)),  # type: ignore[arg-type]
        )


@pytest.mark.conformance(trainer="fsdp2", engine="torch", transport="mooncake", via="torch pause modes")
def test_a_session_pauses_each_engine_in_its_first_mode_that_aborts_nothing_and_refuses_what_it_lacks():
    with engines() as group:
        group.start("a")
        wait_for(lambda: group.rendezvous.read_engine("a"), 60, "engine a's table")
        source = FSDP2Source(small_model(0))
        with Session(source=source, rendezvous=group.rendezvous, transport="mooncake", check=True) as session:
            session.connect(["a"])
            report = session.update("v1")
            assert report.ok and report.engines["a"].pause == "wait", report.format()
            with pytest.raises(OptionsError, match="engine a cannot pause in mode 'retract'; it has wait, abort"):
                session.update("v2", pause="retract")
            info = post(group.rendezvous.read_engine("a")[0].control_url, "info", token=group.rendezvous.token(),
                        timeout=5)
            assert (info["version"], info["updating"], info["serving"]) == ("v1", None, True)  # nothing paused
            assert session.update("v2", pause="abort").engines["a"].pause == "abort"
        with Session(source=source, rendezvous=group.rendezvous, transport="mooncake", pause="in_place") as session:
            with pytest.raises(ConnectError, match="engine a cannot pause in mode 'in_place'; it has wait, abort"):
                session.connect(["a"])
