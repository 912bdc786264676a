"""`p2psync status` (issue #47): a job's engines as each rank says itself. The oracle: what the
test did to each engine (updated, never updated, stopped cleanly, killed) and the trainer's own
report of the update, never the status code's view of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.rendezvous import Rendezvous
from p2psync.status import format_status, job_status
from p2psync.trainer.session import Session
from tests.helpers.engines import engines, small_model

pytest.importorskip("mooncake.engine", reason="the engines are written over Mooncake (extra 'mooncake')")


def test_status_lists_every_engine_of_the_job_with_its_version_and_state():
    with engines() as group:
        for engine in ("a", "b", "c", "d"):
            group.start(engine)
        before = time.time()
        with Session(source=FSDP2Source(small_model(0)), rendezvous=group.rendezvous, transport="mooncake") as session:
            session.connect(["a", "b"])
            report = session.update("v7")
        assert report.ok
        group.stop("c")  # a clean shutdown withdraws its table
        group.kill("d")  # a crash leaves it, and nothing answers there

        ranks = {r.engine_id: r for r in job_status(group.rendezvous, timeout=2)}
        assert list(ranks) == ["a", "b", "c", "d"]
        for engine in ("a", "b"):
            assert (ranks[engine].version, ranks[engine].state, ranks[engine].rank) == ("v7", "serving", 0)
            assert before <= ranks[engine].finished_at <= time.time()
        assert (ranks["c"].state, ranks["c"].rank) == ("withdrawn", None)
        assert "no table in the rendezvous" in ranks["c"].error
        assert ranks["d"].state == "unreachable" and "got no answer" in ranks["d"].error

        text = format_status(list(ranks.values()))
        assert text.splitlines()[0].split() == ["engine", "rank", "host", "version", "state", "last", "update"]
        assert any(line.split()[:5] == ["a", "0", "127.0.0.1", "v7", "serving"] for line in text.splitlines())

        cli = subprocess.run(
            [sys.executable, "-m", "p2psync.cli", "status", "--rendezvous", f"127.0.0.1:{group.rendezvous.port}",
             "--job", group.rendezvous.job_id, "--json", "--timeout", "2"],
            capture_output=True, text=True, timeout=60,
        )
        assert cli.returncode == 1, cli.stderr  # not every rank serves
        lines = [json.loads(line) for line in cli.stdout.splitlines()]
        assert [(r["engine_id"], r["state"], r["version"]) for r in lines] == [
            ("a", "serving", "v7"), ("b", "serving", "v7"), ("c", "withdrawn", None), ("d", "unreachable", None),
        ]


def test_an_engine_waiting_for_its_first_update_says_so_and_a_job_without_engines_exits_2():
    with engines() as group:
        group.start("fresh")
        group.rendezvous.read_engine("fresh", timeout=60)  # its table is up
        (fresh,) = job_status(group.rendezvous, timeout=2)
        assert (fresh.engine_id, fresh.version, fresh.state) == ("fresh", None, "waiting for its first update")
        cli = subprocess.run(
            [sys.executable, "-m", "p2psync.cli", "status", "--rendezvous", f"127.0.0.1:{group.rendezvous.port}",
             "--job", "nobody", "--timeout", "1"],
            capture_output=True, text=True, timeout=60,
        )
        assert cli.returncode == 2 and "no engine has published a table" in cli.stdout, (cli.stdout, cli.stderr)


def test_status_lists_the_demos_engines_with_their_versions_while_it_runs():
    demo = subprocess.Popen(
        [sys.executable, "-m", "p2psync.cli", "demo", "--size", "tiny", "--updates", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        command = ""
        while "p2psync status" not in command:
            command = demo.stdout.readline()
            assert command, "the demo ended without saying how to ask its status"
        words = command.split("p2psync status", 1)[1].split()
        address, job = words[words.index("--rendezvous") + 1], words[words.index("--job") + 1]
        host, port = address.rsplit(":", 1)
        rendezvous = Rendezvous(host=host, port=int(port), job_id=job, timeout=60)
        deadline = time.monotonic() + 120
        seen: list = []
        while time.monotonic() < deadline and demo.poll() is None:
            seen = job_status(rendezvous, timeout=2)
            if len(seen) == 2 and all(r.state == "serving" for r in seen):
                break
            time.sleep(0.5)
        assert [r.engine_id for r in seen] == ["engine-0", "engine-1"], seen
        assert all(r.state == "serving" and r.version.startswith("fsdp2/gather-free-") for r in seen), seen
    finally:
        os.killpg(demo.pid, signal.SIGKILL)  # the demo and its engine and trainer processes
        demo.wait(30)
