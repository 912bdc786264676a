"""`p2psync status` (issue #47): a job's engines as each rank says itself. The oracle: what the
test did to each engine (updated, never updated, stopped cleanly, killed) and the trainer's own
report of the update, never the status code's view of them."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable

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
    """Run on a terminal, the demo also shows its bars: the connect in layouts, the updates in bytes."""
    demo, told = _on_a_terminal([sys.executable, "-m", "p2psync.cli", "demo", "--size", "tiny", "--updates", "400"])
    try:
        command = told.wait_for(lambda text: "p2psync status" in text, "how to ask its status")
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
        # tqdm's bars: "connecting: 100%|...| 1/1 [...layout/s]", "syncing:  3%|...| 418k/41.8M [...kB/s]"
        told.wait_for(lambda text: re.search(r"connecting: 100%.*\| 1/1 .*layout/s", text), "a connect bar in layouts")
        told.wait_for(lambda text: re.search(r"syncing: .*\| [0-9.]+k/[0-9.]+M .*B/s", text), "a sync bar in bytes")
    finally:
        os.killpg(demo.pid, signal.SIGKILL)  # the demo and its engine and trainer processes
        demo.wait(30)
        os.close(told.master)


class Terminal:
    """What a process wrote to its terminal, read as it comes (a reader that falls behind
    would block the writer: a terminal's buffer is small)."""

    def __init__(self, master: int) -> None:
        self.master, self.more = master, threading.Condition()
        self.lines: list[str] = [""]  # the last one still being written
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while not self.closed:
            try:
                chunk = os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the process and its children closed the terminal
                chunk = ""
            with self.more:
                *done, rest = re.split(r"[\r\n]", self.lines.pop() + chunk)
                self.lines += [*done, rest]
                self.closed = not chunk
                self.more.notify_all()

    def wait_for(self, wanted: Callable[[str], object], what: str, timeout: float = 120) -> str:
        """The first line `wanted` accepts; fails naming `what` was not written."""
        deadline, checked = time.monotonic() + timeout, 0
        with self.more:
            while True:
                for line in self.lines[checked:]:
                    if wanted(line):
                        return line
                checked = len(self.lines) - 1  # the last line may grow
                if self.closed:
                    pytest.fail(f"the process ended without writing {what}: {self.lines[-40:]}")
                if not self.more.wait(max(0.0, deadline - time.monotonic())):
                    pytest.fail(f"no {what} in {timeout} s: {self.lines[-40:]}")


def _on_a_terminal(command: list[str]) -> tuple[subprocess.Popen[bytes], Terminal]:
    """`command` started on a terminal of its own, 120 columns wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new one has 0 columns
    process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    return process, Terminal(master)
