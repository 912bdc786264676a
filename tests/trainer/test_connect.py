"""Connect: engines that come and go (a dead one left out by name, the others connected),
bad input refused with a clear error before anything is written, and only the job's trainer
admitted."""

from __future__ import annotations

import dataclasses
import logging

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.doubles import CountingTransport  # noqa: E402
from tests.helpers.engines import RecordingTransport, small_model, wait_for  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.adapters.torch import serve  # noqa: E402
from p2psync.adapters.torch.target import TorchEngineTarget  # noqa: E402
from p2psync.core.control import post  # noqa: E402
from p2psync.core.errors import ConnectError  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from p2psync.trainer.layouts import LayoutCounts, forget_layouts  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.core.types import TargetParam, TargetTable  # noqa: E402
from p2psync.transports.mooncake.transport import MooncakeTransport  # noqa: E402


def session_for(rendezvous, model=None, **kwargs) -> Session:
    kwargs.setdefault("transfer_timeout", 5.0)
    kwargs.setdefault("check", True)
    kwargs.setdefault("transport", "mooncake")
    return Session(source=FSDP2Source(model or small_model(0)), rendezvous=rendezvous, **kwargs)


def test_engines_join_leave_and_restart_without_rebuilding_the_others(monkeypatch, engine_group):
    forget_layouts()  # what a fresh process holds: no earlier test's layouts of these engines
    built = []
    original = TorchEngineTarget.layout
    monkeypatch.setattr(TorchEngineTarget, "layout", lambda self, t, s: built.append(t.engine_id) or original(self, t, s))
    transport = CountingTransport()
    engine_group.start("a")
    engine_group.start("b")
    with session_for(engine_group.rendezvous, transport=transport) as session:
        session.connect(["a", "b"])
        assert session.update("v1").ok
        assert (built, transport.opened) == (["a"], ["a", "b"])  # one layout key, two peers

        engine_group.start("c", dtype="bfloat16")  # joins, with a layout of its own
        session.connect(["a", "b", "c"])
        assert (built[1:], transport.opened[2:]) == (["c"], ["c"])
        assert session.update("v2").ok

        engine_group.stop("b")  # leaves
        session.connect(["a", "c"])
        assert {t.engine_id for t in session.plan.assignment} == {"a", "c"}
        assert (built[2:], transport.opened[3:]) == ([], [])
        report = session.update("v3")
        assert report.ok and set(report.engines) == {"a", "c"}

        engine_group.stop("a")  # restarts: new process, new addresses, same layout key
        engine_group.start("a", seed=7)
        session.connect(["a", "c"])
        assert (built[2:], transport.opened[3:]) == ([], ["a"])
        assert session.stats().layouts == LayoutCounts(memory=2), "the table read, a peer opened: nothing compiled"
        assert session.update("v4").ok


def test_a_dead_engine_is_left_out_by_name_and_rejoins_once_it_answers(engine_group, caplog):
    """Engine b is killed (its table stays in the rendezvous) while a restarts: the reconnect
    leaves b out, naming it in its report and a warning, and a and c connect and update; a
    shape that disagrees still fails the connect; b rejoins once it runs again. With
    `strict_connect`, the dead engine fails the connect."""
    for engine in ("a", "b", "c"):
        engine_group.start(engine)
    engine_group.start("wide", width=48)
    model = small_model(0)
    with session_for(engine_group.rendezvous, model) as session:
        assert session.connect(["a", "b", "c"]).ok
        assert session.update("v1").ok
        engine_group.kill("b")
        engine_group.stop("a")
        engine_group.start("a", seed=7)
        with caplog.at_level(logging.WARNING, logger="p2psync.trainer.session"):
            connected = session.connect(["a", "b", "c"])
        assert (connected.engines, list(connected.left_out)) == (["a", "c"], ["b"])
        assert connected.left_out["b"].startswith("it does not answer (killed, stopped or cut off): engine 'b' rank 0")
        (said,) = [r.getMessage() for r in caplog.records]
        who = f"[job {engine_group.rendezvous.job_id} trainer 0]"
        assert said.startswith(f"{who} engine b left out of this connect: i"), said
        report = session.update("v2")
        assert report.ok and sorted(report.engines) == ["a", "c"], report.format()
        table = engine_group.rendezvous.read_engine("a")[0]
        held = post(table.control_url, "state", token=session.token, timeout=5)
        assert held == {n: p.detach().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                        for n, p in model.state_dict().items()}  # torch's own bytes of the trainer's weights

        with pytest.raises(ConnectError, match="engine 'wide' rank 0 parameter '1.weight'"):
            session.connect(["a", "b", "wide"])  # the trainer's to fix: never left out

        dead = engine_group.rendezvous.read_engine("b")[0].incarnation
        engine_group.start("b")
        wait_for(lambda: engine_group.rendezvous.read_engine("b")[0].incarnation > dead, 60, "b's new table")
        assert session.connect(["a", "b", "c"]).ok
        assert sorted(session.update("v3").engines) == ["a", "b", "c"]

    engine_group.kill("b")
    with session_for(engine_group.rendezvous, strict_connect=True) as strict:
        with pytest.raises(ConnectError, match="engine 'b' is not there to serve: it does not answer"):
            strict.connect(["a", "b", "c"])


def test_shape_mismatch_is_refused_at_connect_and_nothing_is_written(engine_group):
    engine_group.start("wide", width=48)
    with session_for(engine_group.rendezvous) as session:
        with pytest.raises(ConnectError) as error:
            session.connect(["wide"])
    assert "engine 'wide' rank 0 parameter '1.weight'" in str(error.value)
    assert "shape [96, 48] on the engine, [64, 32] on the trainer" in str(error.value)
    table = engine_group.rendezvous.read_engine("wide")[0]
    token = engine_group.rendezvous.token()
    status = post(table.control_url, "info", token=token, timeout=5)
    assert (status["version"], status["updating"], status["stale"]) == (None, None, None)  # never paused for an update


def test_a_trainer_with_another_token_is_refused(engine_group):
    engine_group.start("a")
    with session_for(engine_group.rendezvous, token="not-this-job") as session:
        with pytest.raises(ConnectError, match="engine 'a' rank 0.*403.*wrong or missing job token"):
            session.connect(["a"])


def fake_table(rendezvous: Rendezvous, **changes) -> TargetTable:
    """The table a torch engine with `small_model` would publish, with `changes`."""
    model = small_model(0)
    params = tuple(
        TargetParam(name, tuple(p.shape), "float32", 4096 * (i + 1), p.numel() * 4)
        for i, (name, p) in enumerate(model.named_parameters())
    )
    table = TargetTable(
        engine_id="x", rank=0, world_size=1, engine="torch", layout_key={"params": "fake"}, transport="mooncake",
        transport_info={"session": "127.0.0.1:1"}, control_url="http://127.0.0.1:1", params=params,
        job_id=rendezvous.job_id,
    )
    return dataclasses.replace(table, **changes)


def without(params, name):
    return tuple(p for p in params if p.name != name)


def as_dtype(params, name, dtype):
    return tuple(dataclasses.replace(p, dtype=dtype, nbytes=p.nbytes // 4 * 4) if p.name == name else p for p in params)


BAD_TABLES = {
    "engine lacks a trainer tensor": (
        lambda t: {"params": without(t.params, "3.weight")},
        "engine 'x' rank 0: no parameter for trainer HF tensors ['3.weight']",
    ),
    "engine has a tensor the trainer lacks": (
        lambda t: {"params": t.params + (TargetParam("extra.weight", (4,), "float32", 1 << 20, 16),)},
        "engine 'x' rank 0 parameter 'extra.weight': the trainer has no such HF tensor",
    ),
    "dtype of another kind": (
        lambda t: {"params": as_dtype(t.params, "0.weight", "int32")},
        "engine 'x' rank 0 parameter '0.weight': dtype int32 on the engine, float32 on the trainer",
    ),
    "no adapter for the engine kind": (
        lambda t: {"engine": "nosuchengine"},
        "engine 'x' rank 0: no engine target named 'nosuchengine' is installed",
    ),
    "another transport": (
        lambda t: {"transport": "nixl"},
        "engine 'x' rank 0 published for transport 'nixl', but this trainer uses 'mooncake'",
    ),
    "another job": (
        lambda t: {"job_id": "other-job"},
        "engine 'x' rank 0 joined job 'other-job'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_tables_are_refused_with_a_clear_error(case):
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="bad", is_server=True, timeout=2)
    change, message = BAD_TABLES[case]
    table = fake_table(rendezvous)
    rendezvous.publish(dataclasses.replace(table, **change(table)))
    with session_for(rendezvous) as session:
        with pytest.raises(ConnectError) as error:
            session.connect(["x"])
    assert message in str(error.value)


def test_one_layout_key_with_different_parameters_is_refused_naming_the_parameter():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="bad", is_server=True, timeout=2)
    x = fake_table(rendezvous)
    y = dataclasses.replace(x, engine_id="y", params=tuple(
        dataclasses.replace(p, shape=(p.shape[0] // 2, *p.shape[1:]), nbytes=p.nbytes // 2) if p.name == "1.bias" else p
        for p in x.params
    ))  # the same layout key: a rank of y would be served x's bytes
    rendezvous.publish(x)
    rendezvous.publish(y)
    transport = CountingTransport()
    with session_for(rendezvous, transport=transport) as session:
        with pytest.raises(ConnectError) as error:
            session.connect(["x", "y"])
    assert "engine 'y' rank 0 parameter '1.bias' differs from the parameter of another engine rank with the same " \
        "layout key" in str(error.value)
    assert transport.opened == []  # refused before any peer was opened: nothing written


@pytest.mark.parametrize(
    "payload, message",
    [
        (b'{"engine_id": "x", "rank": 0, "wor', "target table does not parse"),
        (b"\x00\xffgarbage", "target table does not parse"),
        (b'{"engine_id": "x"}', "target table does not parse"),
    ],
    ids=["truncated", "garbage", "missing fields"],
)
def test_corrupted_rendezvous_data_is_refused(payload, message):
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="bad", is_server=True, timeout=2)
    rendezvous.set("engine/x/world_size", "1")
    rendezvous.set("engine/x/rank/0", payload)
    with session_for(rendezvous) as session:
        with pytest.raises(ConnectError, match=message):
            session.connect(["x"])


def test_missing_engine_is_refused_in_time():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="bad", is_server=True, timeout=1)
    with session_for(rendezvous) as session:
        with pytest.raises(ConnectError, match="'engine/ghost/world_size' of engine 'ghost' not published within 1 s"):
            session.connect(["ghost"])


def test_an_engine_registers_exactly_its_parameter_memory_and_patch_area():
    model = small_model(0)
    model.register_buffer("running_stat", torch.zeros(1000))  # not a parameter: never exposed
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="reg", is_server=True)
    transport = RecordingTransport()
    endpoint = serve(model, engine_id="e", rendezvous=rendezvous, transport=transport)
    try:
        expected = sorted((p.data_ptr(), p.numel() * p.element_size()) for p in model.parameters())
        area = (endpoint.patches.tensor.data_ptr(), endpoint.patches.nbytes)  # where delta patches land
        assert sorted(transport.exposed) == sorted([*expected, area])
        published = rendezvous.read_engine("e")[0]
        assert sorted((p.addr, p.nbytes) for p in published.params) == expected
        assert published.patch_area == area
    finally:
        endpoint.close()


def test_engine_options_reach_the_engine_target():
    from dataclasses import dataclass

    from p2psync.core.plugins import Registry

    seen = []

    @dataclass(frozen=True)
    class LayoutChoice:
        layout: str = "copy"

    class Recording(TorchEngineTarget):
        Options = LayoutChoice

        def __init__(self, **options):
            super().__init__(**options)
            seen.append(self.options)

    registry = Registry()
    registry.add("engine_targets", Recording, "test", "0")
    registry.add("transports", MooncakeTransport, "p2psync", "0")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="opts", is_server=True, timeout=2)
    rendezvous.publish(fake_table(rendezvous, job_id="opts"))
    with session_for(rendezvous, registry=registry, engine_options={"torch": {"layout": "replica"}}) as session:
        with pytest.raises(ConnectError, match="engine 'x' rank 0: info at"):  # the fake engine is not reachable
            session.connect(["x"])
    assert seen == [LayoutChoice(layout="replica")]


def test_an_unknown_engine_option_is_refused_at_connect_naming_the_valid_ones():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="opts", is_server=True, timeout=2)
    rendezvous.publish(fake_table(rendezvous, job_id="opts"))
    with session_for(rendezvous, engine_options={"torch": {"layuot": "replica"}}) as session:
        with pytest.raises(ConnectError, match=r"engine 'x' rank 0: engine target 'torch': unknown option\(s\) \['layuot'\]; valid options: none"):
            session.connect(["x"])
