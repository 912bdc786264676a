"""Reliability (issue #20), tox env py: each failure found when p2psync was tried as a new
user would, with the error text the user sees.

1. a refused connect leaves the session as it was, on every trainer rank;
2. one engine id, one engine: a second live publisher is refused, a restart replaces its
   predecessor by incarnation, duplicate ids in `connect` are an error;
3. a lost trainer rank is a p2psync error naming it; an engine whose update is abandoned
   marks itself stale, stays out of serving and says so; engines serve only known weights;
4. zero-element parameters;
5. an unreachable rendezvous fails within its timeout, naming host, port, job and key.
Port races and repeated sessions: test_ports_and_cycles.py.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import ANY

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import RecordingTransport, engines, small_model, wait_for  # noqa: E402
from tests.helpers.steps import after_step  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.adapters.torch import serve  # noqa: E402
from p2psync.core.control import ControlServer, post  # noqa: E402
from p2psync.engine.endpoint import EndpointControl, EngineHooks  # noqa: E402
from p2psync.core.errors import (  # noqa: E402
    ConnectError, ControlError, P2PSyncError, RendezvousError, TrainerRankFailed, UpdateError,
)
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.core.types import TargetParam, TargetTable  # noqa: E402
from p2psync.worlds.processes import context, process  # noqa: E402

TIMEOUT = 3.0


def session_for(rendezvous: Rendezvous, model: torch.nn.Module | None = None, **kwargs) -> Session:
    kwargs.setdefault("transfer_timeout", TIMEOUT)
    kwargs.setdefault("check", True)
    kwargs.setdefault("transport", "mooncake")
    return Session(source=FSDP2Source(model or small_model(0)), rendezvous=rendezvous, **kwargs)


def status(rendezvous: Rendezvous, engine_id: str, *, url: str | None = None) -> dict:
    """What engine `engine_id` rank 0 says about itself (its status call)."""
    url = url or rendezvous.read_engine(engine_id)[0].control_url
    return post(url, "info", token=rendezvous.token(), timeout=10)


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))


@contextmanager
def foreign_engine(rendezvous: Rendezvous, engine_id: str) -> Iterator[str]:
    """An engine of `small_model`'s shapes whose control endpoint holds another job's token:
    connect must refuse it (403) after building its layout and opening its peers."""
    server = ControlServer({"info": lambda body: {}}, token="another-job")
    params = tuple(
        TargetParam(name, tuple(p.shape), "float32", 4096 * (i + 1), p.numel() * 4)
        for i, (name, p) in enumerate(small_model(0).named_parameters())
    )
    table = TargetTable(
        engine_id=engine_id, rank=0, world_size=1, engine="torch", layout_key={"params": "foreign"},
        transport="mooncake", transport_info={"session": "127.0.0.1:1"}, control_url=server.url, params=params,
        job_id=rendezvous.job_id, instance=f"foreign:{engine_id}",
    )
    assert rendezvous.publish(table) is None
    try:
        yield server.url
    finally:
        rendezvous.unpublish(table)
        server.close()


# -- 1. atomic connect ------------------------------------------------------------------


def test_a_refused_connect_leaves_the_last_good_connection_usable():
    with engines() as group:
        group.start("a")
        model = small_model(0)
        with session_for(group.rendezvous, model) as session:
            session.connect(["a"])
            assert session.update("v1").ok
            with foreign_engine(group.rendezvous, "x") as url:
                with pytest.raises(ConnectError) as error:
                    session.connect(["a", "x"])
            assert f"engine 'x' rank 0: info at {url} answered 403" in str(error.value)
            assert "wrong or missing job token" in str(error.value)
            perturb(model, 1)
            report = session.update("v2")
            assert report.ok and set(report.engines) == {"a"}, report.format()
            assert report.engines["a"].checked  # the digests of the new bytes were compared
            assert status(group.rendezvous, "a")["version"] == "v2"


def test_a_refused_first_connect_leaves_update_before_connect():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="refused", is_server=True, timeout=2)
    with foreign_engine(rendezvous, "x"):
        with session_for(rendezvous) as session:
            with pytest.raises(ConnectError, match="engine 'x' rank 0: info at .* answered 403"):
                session.connect(["x"])
            with pytest.raises(P2PSyncError, match="^update before connect$"):
                session.update("v1")


# -- 2. one engine id, one engine -------------------------------------------------------


def test_duplicate_engine_ids_in_connect_are_refused():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="dup", is_server=True, timeout=2)
    with session_for(rendezvous) as session:
        with pytest.raises(ConnectError, match=r"^engine 'a' is named twice in connect\(\['a', 'b', 'a'\]\)$"):
            session.connect(["a", "b", "a"])


def test_a_second_live_publisher_of_an_engine_id_is_refused():
    with engines() as group:
        group.start("a")
        first = group.rendezvous.read_engine("a")[0]
        with pytest.raises(RendezvousError) as error:
            serve(small_model(1), engine_id="a", rendezvous=group.rendezvous, transport=RecordingTransport())
        assert str(error.value).startswith(
            f"engine 'a' rank 0 is already served by incarnation 0 at {first.control_url} ({first.instance}); "
        )
        assert "start this one with incarnation=1 to replace it" in str(error.value)
        assert group.rendezvous.read_engine("a")[0] == first  # nothing replaced
        with session_for(group.rendezvous) as session:
            session.connect(["a"])
            assert session.update("v1").ok
        assert status(group.rendezvous, "a")["version"] == "v1"


def test_an_explicit_incarnation_replaces_a_live_predecessor_which_stops_serving():
    with engines() as group:
        group.start("a")
        first = group.rendezvous.read_engine("a")[0]
        successor = serve(
            small_model(1), engine_id="a", rendezvous=group.rendezvous, transport=RecordingTransport(), incarnation=1
        )
        try:
            assert group.rendezvous.read_engine("a")[0].incarnation == 1
            old = status(group.rendezvous, "a", url=first.control_url)
            assert old["serving"] is False
            assert old["stale"] == "replaced by incarnation 1 of engine 'a' rank 0"
        finally:
            successor.close()


def test_a_successor_answers_as_itself_while_its_predecessor_is_told_to_retire(monkeypatch):
    """A trainer may read a restarted engine's table and ask who it is before its claim returns
    (it still tells its predecessor to retire, which may take seconds): it answers as the table it
    published, so that the trainer does not leave it out as another process (seen in the chaos
    schedule under load: a restarted engine left out of the connect right after it published)."""
    claiming = importlib.import_module("p2psync.engine.claim")  # the module (p2psync.engine.claim is its function)
    seen = []
    replaced = claiming._replaced

    def asked_meanwhile(holder, table, token):
        seen.append(post(table.control_url, "info", token=token, timeout=10)["instance"])
        replaced(holder, table, token)

    monkeypatch.setattr(claiming, "_replaced", asked_meanwhile)
    with engines() as group:
        group.start("a")
        dead = group.rendezvous.read_engine("a")[0]
        group.kill("a")
        group.rendezvous.publish(dead, replacing=group.rendezvous.read_engine("a")[0])  # its place still its own
        successor = serve(small_model(1), engine_id="a", rendezvous=group.rendezvous, transport=RecordingTransport())
        try:
            table = group.rendezvous.read_engine("a")[0]
            assert table.incarnation == 1 and seen == [table.instance], seen
        finally:
            successor.close()


def test_a_restarted_engine_replaces_its_dead_predecessor_as_the_next_incarnation():
    with engines() as group:
        group.start("a")
        assert group.rendezvous.read_engine("a")[0].incarnation == 0
        group.kill("a")
        group.start("a", seed=3)
        table = wait_for(
            lambda: next((t for t in group.rendezvous.read_engine("a") if t.incarnation == 1), None),
            60,
            "incarnation 1",
        )
        with session_for(group.rendezvous) as session:
            session.connect(["a"])
            assert session.tables["a"][0] == table
            assert session.update("v1").ok


# -- 3. lost trainers and abandoned updates -------------------------------------------------


def test_an_abandoned_update_marks_the_engine_stale_until_the_next_update(caplog):
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="lease", is_server=True, timeout=5)
    stale: list[str] = []
    hooks = EngineHooks(on_stale=stale.append, routes={"generate": lambda body: {"tokens": [1, 2]}})
    endpoint = serve(
        small_model(1), engine_id="e", rendezvous=rendezvous, transport=RecordingTransport(), hooks=hooks, version="v0"
    )
    try:
        control = EndpointControl(rendezvous.read_engine("e"), timeout=5, token=rendezvous.token())
        url = endpoint.url
        assert post(url, "generate", token=rendezvous.token(), timeout=5) == {"tokens": [1, 2]}
        control.pause("v1", lease=0.5, mode="wait")
        with pytest.raises(ControlError, match="engine 'e' rank 0 is not serving: it is being updated to version 'v1'"):
            post(url, "generate", token=rendezvous.token(), timeout=5)
        reason = (
            "update abandoned at version 'v1' (was serving 'v0'): no finish within 0.5 s of its start or last "
            "renewal; its weights may be mixed"
        )
        wait_for(lambda: status(rendezvous, "e")["stale"], 5, "the stale mark")
        assert status(rendezvous, "e") == {
            "rank": 0, "incarnation": 0, "instance": ANY, "pause_modes": ["wait", "abort"],
            "version": "v0", "updating": "v1", "serving": False,
            "stale": reason, "finished_at": ANY,
        }
        assert stale == [reason]
        assert any(r.levelname == "ERROR" and reason in r.getMessage() for r in caplog.records)
        with pytest.raises(ControlError, match=re.escape(f"engine 'e' rank 0 is not serving: {reason}")):
            post(url, "generate", token=rendezvous.token(), timeout=5)

        control.pause("v2", lease=30, mode="wait")  # the next update
        control.finish("v2")
        assert status(rendezvous, "e") == {
            "rank": 0, "incarnation": 0, "instance": ANY, "pause_modes": ["wait", "abort"],
            "version": "v2", "updating": None, "serving": True,
            "stale": None, "finished_at": ANY,
        }
        assert post(url, "generate", token=rendezvous.token(), timeout=5) == {"tokens": [1, 2]}
    finally:
        endpoint.close()


def test_an_engine_serves_no_weights_of_unknown_version():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="fresh", is_server=True, timeout=5)
    paused: list[str] = []
    hooks = EngineHooks(pause=paused.append, routes={"generate": lambda body: {"tokens": [3]}})
    endpoint = serve(small_model(1), engine_id="e", rendezvous=rendezvous, transport=RecordingTransport(), hooks=hooks)
    try:
        assert paused == ["abort"]  # held out of serving from the start (nothing in flight)
        assert status(rendezvous, "e")["serving"] is False
        with pytest.raises(ControlError) as error:
            post(endpoint.url, "generate", token=rendezvous.token(), timeout=5)
        assert (
            "engine 'e' rank 0 is not serving: it holds weights of no known version (waiting for its first update)"
            in str(error.value)
        )
        assert "503" in str(error.value)
    finally:
        endpoint.close()
    declared = serve(
        small_model(1), engine_id="d", rendezvous=rendezvous, transport=RecordingTransport(), hooks=hooks,
        version="ckpt-0",
    )
    try:
        assert status(rendezvous, "d")["serving"] is True
        assert post(declared.url, "generate", token=rendezvous.token(), timeout=5) == {"tokens": [3]}
    finally:
        declared.close()


def test_a_trainer_failing_mid_update_raises_a_p2psync_error_and_the_engine_goes_stale():
    with engines() as group:
        group.start("a")
        # gathering one tensor per bucket: the crash comes between buckets, mid-update
        with session_for(group.rendezvous, bucket_bytes=1, update_lease=2.0, gather="always") as session:
            session.connect(["a"])
            assert session.update("v1").ok

            def crash() -> None:
                raise RuntimeError("the trainer crashed")

            with pytest.raises(UpdateError) as error:  # named as the steps count: crashed after the second
                session.update("v2", progress=after_step(2, crash))
            crashed = "RuntimeError in step 2 of 6 (bucket 2 of 6): the trainer crashed"
            assert str(error.value) == f"update 'v2' failed on trainer rank 0: {crashed}"
            assert isinstance(error.value, TrainerRankFailed)
            assert error.value.failures == {0: crashed}
            with pytest.raises(UpdateError, match="this session is unusable after update 'v2' failed; close it"):
                session.update("v3")
        reason = wait_for(lambda: status(group.rendezvous, "a")["stale"], 10, "the stale mark")
        assert reason.startswith("update 'v2' given up by the trainer (was serving 'v1'): update 'v2' failed on "
                                 f"trainer rank 0: {crashed}"), reason
        with session_for(group.rendezvous) as session:  # the next trainer
            session.connect(["a"])
            assert session.update("v3").ok
        assert status(group.rendezvous, "a") == {
            "rank": 0, "incarnation": 0, "instance": ANY, "pause_modes": ["wait", "abort"],
            "version": "v3", "updating": None, "serving": True,
            "stale": None, "finished_at": ANY,
        }


def fsdp2_rank(rank: int, port: int, job_id: str, world: str = "gloo") -> tuple[Rendezvous, torch.nn.Module]:
    """Trainer rank `rank` of a 2-rank gloo world (its store keys under `world`/), holding
    `small_model(0)` under FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2psync.core.logs import configure

    configure(f"trainer {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=job_id, timeout=30)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{world}/", rendezvous._root), rank=rank, world_size=2)
    model = small_model(0)
    for layer in model:
        fully_shard(layer)
    return rendezvous, model


def trainer_rank(rank: int, port: int, job_id: str, results) -> None:
    """Trainer rank of a 2-rank FSDP2 world: a refused connect, then an update that rank 1 dies in."""
    rendezvous, model = fsdp2_rank(rank, port, job_id)
    session = session_for(rendezvous, model, bucket_bytes=1, update_lease=4.0, gather="always")  # dies mid-gathers
    session.connect(["a"])
    assert session.update("v1").ok
    try:
        session.connect(["a", "x"])
        refused = ""
    except ConnectError as exc:
        refused = str(exc)
    report = session.update("v2")
    results.put((rank, "refused", refused, report.ok, sorted(report.engines)))

    die = after_step(2, lambda: os.kill(os.getpid(), signal.SIGKILL)) if rank == 1 else None
    started = time.monotonic()
    try:
        session.update("v3", progress=die)
        results.put((rank, "lost", "no error", 0.0))
    except P2PSyncError as exc:
        results.put((rank, "lost", f"{type(exc).__name__}: {exc}", time.monotonic() - started))
    results.close()
    results.join_thread()
    os._exit(0)  # the world is broken: no orderly teardown


def collect(results, count: int, procs: list, timeout: float) -> list:
    """`count` results, failing early once every process has exited without sending them."""
    import queue

    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            got.append(results.get(timeout=1))
        except queue.Empty:
            if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                raise AssertionError(f"only {len(got)} of {count} results: {got}") from None
    return got


def test_a_lost_trainer_rank_is_named_and_the_engine_does_not_resume_mixed_weights():
    with engines() as group:
        group.start("a")
        ctx = context()
        results = ctx.Queue()
        with foreign_engine(group.rendezvous, "x"):
            ranks = [
                process(ctx, trainer_rank, (r, group.rendezvous.port, group.rendezvous.job_id, results))
                for r in range(2)
            ]
            for p in ranks:
                p.start()
            got = collect(results, 3, ranks, timeout=180)
            for p in ranks:
                p.join(30)
        refused = sorted(g for g in got if g[1] == "refused")
        assert [g[0] for g in refused] == [0, 1]
        for _, _, error, ok, engines_ in refused:  # every rank refused alike and kept its connection
            assert "engine 'x' rank 0: info at" in error and "403" in error
            assert ok and engines_ == ["a"]
        lost = [g for g in got if g[1] == "lost"]
        assert [g[0] for g in lost] == [0]
        _, _, error, seconds = lost[0]
        assert error.startswith("TrainerLost: update 'v3' failed: trainer rank 1 was lost"), error
        assert seconds < 30
        reason = wait_for(lambda: status(group.rendezvous, "a")["stale"], 15, "the stale mark")
        # the surviving world rank 0 tells the engine at once
        assert reason.startswith("update 'v3' given up by the trainer (was serving 'v2'): update 'v3' failed: "
                                 "trainer rank 1 was lost"), reason
        assert status(group.rendezvous, "a")["serving"] is False
        with session_for(group.rendezvous) as session:  # the next trainer world
            session.connect(["a"])
            assert session.update("v4").ok
        assert status(group.rendezvous, "a")["stale"] is None


def raising_rank(rank: int, port: int, job_id: str, gather: str, results) -> None:
    """Trainer rank of a 2-rank FSDP2 world whose rank 1 raises in `progress` and then lives on."""
    rendezvous, model = fsdp2_rank(rank, port, job_id)
    session = session_for(rendezvous, model, bucket_bytes=1, update_lease=4.0, gather=gather)
    session.connect(["a"])
    assert session.update("v1").ok

    def progress_raises() -> None:
        raise RuntimeError("the caller's progress raised")

    raise_once = after_step(1, progress_raises) if rank == 1 else None

    started = time.monotonic()
    try:
        session.update("v2", progress=raise_once)
        results.put((rank, "no error", {}, 0.0))
    except P2PSyncError as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}", getattr(exc, "failures", None), time.monotonic() - started))
    results.close()
    results.join_thread()
    time.sleep(30 if rank == 1 else 0)  # the failed rank's process lives on: it must not be taken for lost
    os._exit(0)


@pytest.mark.parametrize("gather", ["always", "auto"])
def test_a_rank_whose_own_code_raised_is_named_on_every_rank_at_once(gather):
    """Rank 1's `progress` raises after its first step (a bucket, gathering; a gather-free unit
    otherwise) while its process lives on: both ranks raise TrainerRankFailed naming rank 1 and
    its exception within seconds (before, rank 0 waited as long as rank 1 lived and then called
    it lost), and the engine is not resumed."""
    with engines() as group:
        group.start("a")
        ctx = context()
        results = ctx.Queue()
        ranks = [
            process(ctx, raising_rank, (r, group.rendezvous.port, group.rendezvous.job_id, gather, results))
            for r in range(2)
        ]
        for p in ranks:
            p.start()
        try:
            got = sorted(collect(results, 2, ranks, timeout=120))
        finally:
            for p in ranks:
                p.kill()
                p.join(10)
        for rank, error, failures, seconds in got:
            assert error.startswith("TrainerRankFailed: update 'v2' failed on trainer rank 1: RuntimeError in "), (
                rank, error)
            assert list(failures) == [1] and failures[1].endswith(": the caller's progress raised"), failures
            assert seconds < 10, (rank, seconds)
        assert got[0][2] == got[1][2]
        step = "(bucket 1 of " if gather == "always" else "(gather-free parts for engine 'a' rank 0)"
        assert got[0][2][1].startswith("RuntimeError in step 1 of ") and step in got[0][2][1], got[0][2]
        reason = wait_for(lambda: status(group.rendezvous, "a")["stale"], 15, "the stale mark")
        assert reason.startswith("update 'v2' given up by the trainer (was serving 'v1'): update 'v2' failed on "
                                 "trainer rank 1: RuntimeError in "), reason
        assert status(group.rendezvous, "a")["serving"] is False


# -- 4. zero-element parameters ---------------------------------------------------------------


def with_empty(model: torch.nn.Module) -> torch.nn.Module:
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0, 8)))
    return model


def empty_param_engine(port: int, job_id: str, transport: str, stop) -> None:
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=job_id)
    endpoint = serve(with_empty(small_model(1)), engine_id="z", rendezvous=rendezvous, transport=transport)
    stop.wait()
    endpoint.close()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_zero_element_parameters_are_served_and_updated(transport):
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL (p2psync[nixl]) is not installed")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="empty", is_server=True, timeout=30)
    ctx = context()
    stop = ctx.Event()
    proc = process(ctx, empty_param_engine, (rendezvous.port, "empty", transport, stop), daemon=True)
    proc.start()
    try:
        table = rendezvous.read_engine("z")[0]
        assert [(p.shape, p.nbytes) for p in table.params if p.name == "empty"] == [((0, 8), 0)]
        with session_for(rendezvous, with_empty(small_model(0)), transport=transport) as session:
            session.connect(["z"])
            report = session.update("v1")
            assert report.ok and report.engines["z"].checked, report.format()
            assert report.engines["z"].bytes == table.nbytes
    finally:
        stop.set()
        proc.join(20)


# -- 5. rendezvous errors -----------------------------------------------------------------------


@contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound, never listening, so no
    other process (a test running beside this one) can take it and answer instead."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


RENDEZVOUS_PROBE = """
import sys, time
import torch.distributed
from p2psync.core.rendezvous import Rendezvous
port, timeout, what = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
start = time.monotonic()
try:
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id="job-7", timeout=timeout)
    rendezvous.get("status") if what == "key" else rendezvous.read_engine("ghost")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
print(f"{time.monotonic() - start:.2f}")
"""


def run_probe(port: int, timeout: float, what: str) -> tuple[str, float, str]:
    done = subprocess.run(
        [sys.executable, "-c", RENDEZVOUS_PROBE, str(port), str(timeout), what],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    *lines, seconds = done.stdout.strip().splitlines()
    return "\n".join(lines), float(seconds), done.stderr


def test_an_unreachable_rendezvous_fails_within_its_timeout_naming_host_port_job_and_key():
    with closed_port() as port:
        error, seconds, stderr = run_probe(port, 2.0, "key")
    assert error == (
        f"RendezvousError: no rendezvous answers at 127.0.0.1:{port} (job 'job-7') within 2 s, "
        "waiting for key 'status': connection refused"
    )
    assert seconds < 2.0 + 1.5
    assert "frame #" not in stderr and "Exception raised from" not in stderr and "socket" not in stderr, stderr


def test_a_key_that_never_comes_fails_within_the_timeout_naming_host_port_job_and_key():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="job-7", is_server=True, timeout=30)
    error, seconds, stderr = run_probe(rendezvous.port, 2.0, "engine")
    assert error == (
        f"RendezvousError: rendezvous 127.0.0.1:{rendezvous.port} (job 'job-7'): key 'engine/ghost/world_size' "
        "of engine 'ghost' not published within 2 s"
    )
    assert 2.0 <= seconds < 2.0 + 1.5
    assert "frame #" not in stderr and "Exception raised from" not in stderr, stderr


# -- the sglang server after an abandoned update ------------------------------------------------


@contextmanager
def fake_sglang_server(begin_answer: tuple[int, dict]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering sglang's weight-update routes as sglang 0.5.23 does; yields
    its URL and the paths called."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    calls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(self.path)
            status, body = begin_answer if self.path == "/begin_weight_update" else (200, {"success": True})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()


def test_the_next_update_takes_over_the_weight_update_session_an_abandoned_one_left_open():
    from p2psync.adapters.sglang.server import ServerControl

    message = "a weight-update session is already open; call end_weight_update() first"  # sglang 0.5.23's words
    left_open = (400, {"success": False, "message": message})
    with fake_sglang_server(left_open) as (url, calls):
        ServerControl(url, engine_id="s", timeout=5).pause("v2", 30.0, "retract")
        assert calls == ["/pause_generation", "/begin_weight_update"]
    with fake_sglang_server((400, {"success": False, "message": "out of memory"})) as (url, calls):
        with pytest.raises(ControlError, match="engine 's': /begin_weight_update at .* failed: .*out of memory"):
            ServerControl(url, engine_id="s", timeout=5).pause("v2", 30.0, "retract")


# -- 6. clean ends ----------------------------------------------------------------------------


def ending_rank(rank: int, port: int, job_id: str, case: str, world: str) -> None:
    """Trainer rank of a 2-rank FSDP2 world that meets `case`, then ends as a user's script
    does: `close()` and a plain return (or, "no-close", interpreter exit with the session open).
    Each `world` labels its updates apart: the engine refuses a label an earlier world used."""
    rendezvous, model = fsdp2_rank(rank, port, job_id, world)
    session = session_for(rendezvous, model, bucket_bytes=1, update_lease=4.0)
    session.connect(["a"])
    assert session.update(f"{world}-v1").ok

    def fail_once() -> None:
        if case == "lost-peer":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the caller's progress raised")

    fail = after_step(1, fail_once) if rank == 1 else None

    try:
        if case == "refused-connect":
            session.connect(["a", "narrow"])
        elif case in ("failed-update", "lost-peer"):
            session.update(f"{world}-v2", progress=fail)
        else:
            assert session.update(f"{world}-v2").ok
    except P2PSyncError as exc:
        print(f"rank {rank}: {type(exc).__name__}", flush=True)
    if case != "no-close":
        session.close()


def _ended(proc: subprocess.Popen, timeout: float) -> str:
    """The output of `proc` once it ended; killed (and said so) if it did not within `timeout`."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] + f"\n[did not end within {timeout} s; killed]"


CASES = ["refused-connect", "failed-update", "lost-peer", "no-close", "closed"]


@pytest.mark.parametrize("case", CASES)
def test_every_trainer_process_ends_with_exit_code_0(case):
    """Whatever the session met (a refused connect, a failed update, a lost peer), each trainer
    process p2psync ran threads and transport engines in exits 0 once it returns (a SIGABRT of
    "terminate called without an active exception" was seen after refused connects); the
    killed rank of "lost-peer" excepted. Each case runs twice: the abort came in 2 of 5 runs."""
    with engines() as group:
        group.start("a")
        group.start("narrow", width=16)  # its shapes refuse a connect
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        for attempt in range(2):
            code = (f"from tests.trainer.test_reliability import ending_rank; ending_rank({{rank}}, "
                    f"{group.rendezvous.port}, {group.rendezvous.job_id!r}, {case!r}, 'gloo-{attempt}')")
            procs = [
                subprocess.Popen([sys.executable, "-c", code.format(rank=r)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for r in range(2)
            ]
            outs = [_ended(p, timeout=90) for p in procs]
            codes = [p.returncode for p in procs]
            expected = [0, -signal.SIGKILL] if case == "lost-peer" else [0, 0]
            assert codes == expected, f"attempt {attempt}: exit codes {codes}; output of rank 0:\n{outs[0][-3000:]}\n" \
                                      f"rank 1:\n{outs[1][-3000:]}"
            if case in ("refused-connect", "failed-update"):
                for rank, out in enumerate(outs):
                    error = "ConnectError" if case == "refused-connect" else "TrainerRankFailed"
                    assert f"rank {rank}: {error}" in out, out[-3000:]
