"""NIXL transport: engines in their own processes, the trainer in the test process.

UCX stays on loopback (`ucx_net_devices="lo"`). The engines start together at
module set-up, so the whole module costs about one engine start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from typing import Any

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install p2psync[nixl])")

import torch  # noqa: E402

from p2psync.conformance import TransportTests  # noqa: E402
from p2psync.core.errors import TransferError, TransferTimeout  # noqa: E402
from p2psync.core.transport import WriteBatch  # noqa: E402
from p2psync.core.types import TargetParam, TargetTable  # noqa: E402
from p2psync.transports.nixl.transport import NixlTransport  # noqa: E402
from p2psync.worlds.processes import context, process  # noqa: E402

OPTIONS = {"ucx_net_devices": "lo"}
SIZES = (4096, 65536, 1 << 20)  # bytes of each engine's three parameters
MARGIN = 1.5  # seconds a failing write may take beyond its timeout


def engine_main(sizes: tuple[int, ...], options: dict[str, Any], out: Any, commands: Any) -> None:
    """An engine rank: zeroed parameters exposed over NIXL, digests on request."""
    torch.set_num_threads(1)
    tensors = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    transport = NixlTransport(options=options)
    info = transport.expose(tensors)
    out.put((info, [t.data_ptr() for t in tensors]))
    while (command := commands.get()) != "stop":
        if command == "digests":
            out.put([hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in tensors])
    transport.close()


class Engine:
    def __init__(self, engine_id: str) -> None:
        ctx = context()
        self.engine_id = engine_id
        self.out, self.commands = ctx.Queue(), ctx.Queue()
        self.proc = process(ctx, engine_main, (SIZES, OPTIONS, self.out, self.commands), daemon=True)
        self.proc.start()
        self.info: dict[str, Any] = {}
        self.addrs: list[int] = []

    def wait_ready(self) -> Engine:
        self.info, self.addrs = self.out.get(timeout=120)
        return self

    def table(self) -> TargetTable:
        params = tuple(TargetParam(f"p{i}", (n,), "uint8", a, n) for i, (n, a) in enumerate(zip(SIZES, self.addrs)))
        return TargetTable(
            engine_id=self.engine_id,
            rank=0,
            world_size=1,
            engine="torch",
            layout_key={},
            transport="nixl",
            transport_info=self.info,
            control_url="",
            params=params,
        )

    def digests(self) -> list[str]:
        self.commands.put("digests")
        return self.out.get(timeout=30)

    def stop(self) -> int | None:
        self.commands.put("stop")
        self.proc.join(30)
        return self.proc.exitcode

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture(scope="module")
def engines():
    started = {name: Engine(name) for name in ("main", "killed", "frozen")}
    try:
        yield {name: engine.wait_ready() for name, engine in started.items()}
    finally:
        for engine in started.values():
            engine.kill()


@pytest.fixture(scope="module")
def trainer():
    transport = NixlTransport(options=OPTIONS)
    buffer = torch.zeros(2 << 20, dtype=torch.uint8)
    transport.register_buffer(buffer)
    yield transport, buffer
    transport.unregister_buffer(buffer)
    transport.close()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def fill(buffer: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=g))


def scattered_batch(engine: Engine, buffer: torch.Tensor, expected: list[torch.Tensor]) -> WriteBatch:
    """Several ranges into the three parameters, mirrored into `expected`."""
    base = buffer.data_ptr()
    batch = WriteBatch()

    def add(buf_off: int, param: int, param_off: int, n: int) -> None:
        batch.add(base + buf_off, engine.addrs[param] + param_off, n)
        expected[param][param_off : param_off + n] = buffer[buf_off : buf_off + n]

    add(0, 0, 0, SIZES[0])  # all of p0
    add(10_000, 1, 1_000, 5_000)  # the middle of p1
    add(20_000, 1, 40_000, 3)  # a few odd bytes
    add(100_000, 2, 0, 300_000)  # two ranges that merge into one descriptor
    add(400_000, 2, 300_000, 200_000)
    add(1 << 20, 2, (1 << 20) - 70_000, 70_000)  # the end of p2
    assert len(batch) == 5
    return batch


def test_expose_publishes_json_info(engines):
    info = engines["main"].info
    assert json.loads(json.dumps(info)) == info
    assert info["agent"].startswith("p2psync-") and info["metadata"]
    assert (info["backend"], info["memory"], info["device_id"]) == ("UCX", "DRAM", 0)
    assert len({e.info["agent"] for e in engines.values()}) == len(engines)


def test_plugin_is_registered():
    from p2psync.core.plugins import Plugins

    registry = Plugins.load().registry()
    assert registry.transport("nixl") is NixlTransport
    assert registry.entries["transports"]["nixl"].dependency_status() == (True, "")


def test_writes_land_bit_for_bit(engines, trainer):
    transport, buffer = trainer
    engine = engines["main"]
    peer = transport.open(engine.table())
    expected = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    for seed in (1, 2):  # the second update overwrites the first
        fill(buffer, seed)
        peer.write(scattered_batch(engine, buffer, expected), timeout=20)
        assert engine.digests() == [digest(t) for t in expected]
    peer.write(WriteBatch(), timeout=1)  # nothing to write is no error
    peer.close()


def test_concurrent_writes_to_two_engines(engines, trainer):
    """One write thread per engine, as the pipelined writer runs them, on one agent.
    Every test writes the same ranges, so what an engine holds does not depend on
    which tests ran before."""
    transport, buffer = trainer
    fill(buffer, 3)
    chosen = [engines["main"], engines["killed"]]
    expected = {e.engine_id: [torch.zeros(n, dtype=torch.uint8) for n in SIZES] for e in chosen}
    errors: list[BaseException] = []

    def write(engine: Engine) -> None:
        try:
            peer = transport.open(engine.table())
            for _ in range(5):
                peer.write(scattered_batch(engine, buffer, expected[engine.engine_id]), timeout=20)
            peer.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(e,)) for e in chosen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for engine in chosen:
        assert engine.digests() == [digest(t) for t in expected[engine.engine_id]]


def test_write_outside_registered_memory_names_the_engine(engines, trainer):
    transport, buffer = trainer
    engine = engines["main"]
    peer = transport.open(engine.table())
    batch = WriteBatch()
    batch.add(buffer.data_ptr(), engine.addrs[0] + SIZES[0] - 16, 32)  # runs past p0
    with pytest.raises(TransferError, match="'main'"):
        peer.write(batch, timeout=5)
    batch = WriteBatch()
    batch.add(buffer.data_ptr() + buffer.numel() - 16, engine.addrs[2], 32)  # runs past the buffer
    with pytest.raises(TransferError, match="'main'"):
        peer.write(batch, timeout=5)
    peer.close()


def test_open_without_nixl_info_fails(engines, trainer):
    transport, _ = trainer
    table = engines["main"].table()
    bad = TargetTable(**{**table.__dict__, "transport_info": {"session": "127.0.0.1:1"}})
    with pytest.raises(TransferError, match="published no NIXL agent"):
        transport.open(bad)


def test_write_to_killed_engine_fails_in_time(engines, trainer):
    transport, buffer = trainer
    engine = engines["killed"]
    peer = transport.open(engine.table())
    batch = WriteBatch()
    batch.add(buffer.data_ptr(), engine.addrs[2], SIZES[2])
    peer.write(batch, timeout=20)  # connected and working
    engine.kill()
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(TransferError, match="'killed'"):
        peer.write(batch, timeout=timeout)
    assert time.monotonic() - start < timeout + MARGIN
    peer.close()
    # A trainer that had never reached it: NIXL connects as it loads the metadata,
    # so `open` may already fail; if not, the write must.
    late = NixlTransport(options=OPTIONS)
    try:
        late.register_buffer(buffer)
        start = time.monotonic()
        with pytest.raises(TransferError, match="'killed'"):
            late.open(engine.table()).write(batch, timeout=timeout)
        assert time.monotonic() - start < timeout + MARGIN
    finally:
        late.close()


def test_write_to_frozen_engine_times_out(engines, trainer):
    """A stopped engine cannot answer the connection set-up: the write must give up
    at its timeout, and the peer must work again once the engine runs."""
    transport, buffer = trainer
    engine = engines["frozen"]
    peer = transport.open(engine.table())
    fill(buffer, 4)
    batch = WriteBatch()
    batch.add(buffer.data_ptr(), engine.addrs[1], SIZES[1])
    engine.signal(signal.SIGSTOP)
    try:
        timeout = 1.0
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="'frozen'"):
            peer.write(batch, timeout=timeout)
        elapsed = time.monotonic() - start
        assert timeout <= elapsed < timeout + MARGIN
    finally:
        engine.signal(signal.SIGCONT)
    peer.write(batch, timeout=20)
    assert engine.digests()[1] == digest(buffer[: SIZES[1]])
    peer.close()
    assert engine.stop() == 0  # exits cleanly (see test_processes_exit_cleanly)


def test_processes_exit_cleanly(engines):
    """nixl-cu12 1.5.1, with the system's ibverbs providers installed, crashed every
    process that created a UCX backend at exit (SIGSEGV in libnl, status -11 here);
    the transport keeps UCX's EFA module out to avoid it. The trainer side is this
    process: its exit status is pytest's."""
    assert engines["main"].stop() == 0


class TestNixlConformance(TransportTests):
    """The shared transport suite (engine and trainer agents in this process)."""

    conformance = {"transport": "nixl"}

    @pytest.fixture
    def make_transport(self):
        return lambda: NixlTransport(options=OPTIONS)
