"""Port races and repeated sessions (issue #20), tox env py.

- Engines starting at once on one host: Mooncake picks a random TCP data port, closes its
  check socket and binds the port again moments later, so two processes can take each
  other's port in between ("bind: Address already in use"; once, an sglang engine rank of
  CI died of it). Eight engine processes start their transport at once, twenty times, in
  a port range narrowed to make such collisions common; none may fail.
- A trainer process that connects, updates and closes twenty sessions keeps its threads,
  file descriptors, registered memory and RSS flat.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

from tests.helpers.engines import engines, small_model  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.transports.mooncake.transport import MooncakeTransport  # noqa: E402

ENDPOINTS = 8
ROUNDS = 20
#: Mooncake's port range for the racing engines (it reads MC_MIN/MAX_RPC_PORT once per
#: process): 40 ports for the 16 that 8 Transfer Engines hold (an RPC and a data port each),
#: so that most rounds see a collision. With 24 ports, a loaded CI machine saw an engine lose
#: 20 races in a row (each start picks among the ports the other 7 do not hold yet).
PORTS = (24100, 24139)

#: One engine process, light (no torch): on "go" it exposes a buffer over Mooncake as an
#: engine endpoint does, answers "ok" or the error; on "close" it closes the transport.
ENGINE = """
import ctypes, sys
from p2psync.transports.mooncake.transport import MooncakeTransport

memory = (ctypes.c_uint8 * 4096)()

class Memory:  # the three tensor methods a transport reads
    def data_ptr(self): return ctypes.addressof(memory)
    def numel(self): return len(memory)
    def element_size(self): return 1

for line in sys.stdin:
    if line == "go\\n":
        transport = MooncakeTransport()
        try:
            transport.expose([Memory()])
            print("ok", flush=True)
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}".replace("\\n", " "), flush=True)
    else:
        transport.close()
        del transport
        print("closed", flush=True)
"""


def test_engines_starting_at_once_never_lose_a_port_race():
    env = {
        **os.environ, "MC_MIN_RPC_PORT": str(PORTS[0]), "MC_MAX_RPC_PORT": str(PORTS[1]), "MC_LOG_LEVEL": "ERROR",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env,
        )
        for _ in range(ENDPOINTS)
    ]
    failures = []
    try:
        for round_ in range(ROUNDS):
            for command in ("go", "close"):
                for p in procs:  # all at once: each is blocked reading its next command
                    p.stdin.write(command + "\n")
                    p.stdin.flush()
                for index, p in enumerate(procs):
                    answer = p.stdout.readline().strip()
                    assert answer, f"engine {index} exited with {p.wait()} in round {round_}"
                    if answer not in ("ok", "closed"):
                        failures.append(f"engine {index} round {round_}: {answer}")
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(60)
    assert failures == []


class RacingEngine:
    """A Mooncake Transfer Engine whose first starts lose the port race as real ones do:
    `initialize` raises "bind: Address already in use" ("raise"), or prints Mooncake's
    "unable to find available tcp port" and returns -1 ("return")."""

    races: list[str] = []
    real = None  # the class replaced

    def __init__(self) -> None:
        self._engine = RacingEngine.real()

    def initialize(self, *args):
        if RacingEngine.races:
            if RacingEngine.races.pop(0) == "raise":
                raise RuntimeError("bind: Address already in use")
            os.write(2, b"E1130 tcp_transport.cpp:1] TcpTransport: unable to find available tcp port for data"
                        b" transmission\nE1130 transfer_engine_impl.cpp:436] Failed to install TCP transport\n")
            return -1
        return self._engine.initialize(*args)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def test_an_endpoint_that_loses_a_port_race_starts_again_on_fresh_ports(monkeypatch, caplog):
    import mooncake.engine

    from p2psync.adapters.torch import serve
    from p2psync.core.rendezvous import Rendezvous

    RacingEngine.real = mooncake.engine.TransferEngine
    monkeypatch.setattr(mooncake.engine, "TransferEngine", RacingEngine)
    RacingEngine.races = ["raise", "return", "raise"]
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="race", is_server=True, timeout=10)
    caplog.set_level("INFO", logger="p2psync.transports.mooncake.transport")
    endpoint = serve(small_model(1), engine_id="e", rendezvous=rendezvous, transport="mooncake")
    try:
        assert RacingEngine.races == []
        assert sum("lost a port race" in r.getMessage() for r in caplog.records) == 3
        source = FSDP2Source(small_model(0))
        with Session(source=source, transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["e"])
            report = session.update("v1")
            assert report.ok and report.engines["e"].checked, report.format()
    finally:
        endpoint.close()


def test_a_start_that_fails_for_another_reason_is_not_retried(monkeypatch):
    import mooncake.engine

    from p2psync.core.errors import TransferError

    class BrokenEngine:
        starts = 0

        def initialize(self, *args):
            BrokenEngine.starts += 1
            os.write(2, b"E1130 transfer_engine_impl.cpp:1] Failed to install RDMA transport\n")
            return -1

    monkeypatch.setattr(mooncake.engine, "TransferEngine", BrokenEngine)
    with pytest.raises(TransferError, match=r"returned -1 \(attempt 1\).*Failed to install RDMA transport"):
        MooncakeTransport(options={"protocol": "tcp"}).engine
    assert BrokenEngine.starts == 1


def open_files(peers_of: int) -> dict[str, str]:
    """This process's open file descriptors and what each names (a path, a pipe, a socket's
    ends), but for the connections its peers opened to the server at port `peers_of`."""
    files = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor os.listdir itself held
            continue
        if name.startswith("socket:["):
            name += f" ({socket_ends(name[8:-1])})"
            if f":{peers_of} -> " in name:
                continue
        files[fd] = name
    return files


def socket_ends(inode: str) -> str:
    """A socket's local and remote address from /proc/net, for an error that says which one stayed open."""
    for table in ("tcp", "tcp6", "udp", "udp6", "unix"):
        try:
            lines = open(f"/proc/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if table == "unix" and fields[6] == inode:
                return f"unix {fields[7] if len(fields) > 7 else '(unnamed)'}"
            if table != "unix" and fields[9] == inode:
                return f"{table} {_address(fields[1])} -> {_address(fields[2])} state {fields[3]}"
    return "not in /proc/net"


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    if len(host) == 8:
        host = ".".join(str(b) for b in reversed(bytes.fromhex(host)))
    return f"{host}:{int(port, 16)}"


def process_counts(peers_of: int) -> tuple[int, dict[str, str], int]:
    """Threads (native ones included), open files (`open_files`), resident bytes of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/task")), open_files(peers_of), rss


def settled_counts(
    threads: int, files: dict[str, str], peers_of: int, seconds: float = 10.0
) -> tuple[int, dict[str, str], int]:
    """The counts once threads and files are back to those given, or after `seconds`.

    A thread or a connection the last cycle ended may be gone a moment after the cycle returns
    (a peer's close is read on another thread's time); a leak stays for good, so waiting a few
    seconds tells the two apart.
    """
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        counts = process_counts(peers_of)
        if (counts[0] == threads and len(counts[1]) == len(files)) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_twenty_sessions_in_one_process_leave_nothing_behind():
    with engines() as group:
        group.start("a")
        model = small_model(0)

        def cycle(step: int) -> MooncakeTransport:
            transport = MooncakeTransport()
            source = FSDP2Source(model)
            with Session(source=source, transport=transport, rendezvous=group.rendezvous, check=True) as session:
                session.connect(["a"])
                assert session.update(f"v{step}").ok
                assert transport.registered_bytes == session.stats().buffer_bytes > 0
            assert transport.registered_bytes == 0
            return transport

        cycle(0)  # warm-up: imports, allocator pools, the rendezvous client
        # the rendezvous store lives in this process: the engine's own connections to it are not the trainer's
        store = group.rendezvous.port
        threads, files, rss = settled_counts(-1, {}, store, seconds=0)
        for step in range(1, 21):
            cycle(step)
        after = settled_counts(threads, files, store)
        assert after[0] == threads, f"threads {threads} -> {after[0]}"
        opened = {fd: name for fd, name in after[1].items() if files.get(fd) != name}
        assert len(after[1]) == len(files), f"file descriptors {len(files)} -> {len(after[1])}; new: {opened}"
        assert after[2] - rss < 16 << 20, f"RSS grew by {(after[2] - rss) >> 20} MiB"
