"""An engine rank in its own process, exposing tensors through a transport, for the
samehost and torchdist transport tests; the trainer side runs in the test process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from p2psync.core.plugins import registry
from p2psync.core.rendezvous import Rendezvous
from p2psync.core.transport import WriteBatch
from p2psync.core.types import TargetParam, TargetTable
from p2psync.worlds.processes import context, process

ENGINE_ID = "transport-test"


def engine_tensors() -> dict[str, torch.Tensor]:
    """Parameters of several dtypes; a0..a2 sit back to back in one storage."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(3000, generator=g)
    return {
        "a0": flat[:1000],
        "a1": flat[1000:2500],
        "a2": flat[2500:],
        "b": torch.randn(257, generator=g).to(torch.bfloat16),
        "c": torch.randint(-128, 128, (4097,), generator=g, dtype=torch.int8),
        "d": torch.zeros(3, dtype=torch.float64),
        "e": torch.randint(0, 256, (8 << 20,), generator=g, dtype=torch.uint8),
    }


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def engine_main(transport: str, port: int, job_id: str, conn: Any) -> None:
    """Expose `engine_tensors()`; answer "dump" with their bytes, "conceal" and "expose" with
    what the transport's call returned, until "stop"."""
    torch.set_num_threads(1)
    tensors = engine_tensors()
    side = registry().transport(transport)()
    side.bind(Rendezvous(host="127.0.0.1", port=port, job_id=job_id, timeout=10))
    info = side.expose(list(tensors.values()))
    conn.send(
        (
            info,
            [
                TargetParam(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.data_ptr(), as_bytes(t).numel())
                for n, t in tensors.items()
            ],
        )
    )
    while (command := conn.recv()) != "stop":
        if command == "conceal":
            conn.send(side.conceal(list(tensors.values())))
        elif command == "expose":
            conn.send(side.expose(list(tensors.values())))
        else:  # "dump"
            conn.send({n: as_bytes(t).numpy().tobytes() for n, t in tensors.items()})
    side.close()


@dataclass
class Engine:
    """The test's handle on the engine process."""

    proc: Any
    conn: Any
    table: TargetTable

    def dump(self) -> dict[str, torch.Tensor]:
        self.conn.send("dump")
        assert self.conn.poll(30), "the engine did not answer"
        return {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in self.conn.recv().items()}

    def call(self, command: str) -> Any:
        """What the engine's transport answered to `command` ("conceal", "expose")."""
        self.conn.send(command)
        assert self.conn.poll(30), "the engine did not answer"
        return self.conn.recv()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.join(10)


@contextmanager
def engine(transport: str, job_id: str) -> Iterator[tuple[Engine, Rendezvous]]:
    """An engine process and the rendezvous it joined (hosted by the test process)."""
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id=job_id, is_server=True, timeout=10)
    ctx = context()
    conn, child = ctx.Pipe()
    proc = process(ctx, engine_main, (transport, rendezvous.port, job_id, child), daemon=True)
    proc.start()
    try:
        assert conn.poll(120), "the engine did not start"
        info, params = conn.recv()
        table = TargetTable(
            engine_id=ENGINE_ID,
            rank=0,
            world_size=1,
            engine="torch",
            layout_key={},
            transport=transport,
            transport_info=info,
            control_url="",
            job_id=job_id,
            params=tuple(params),
        )
        yield Engine(proc, conn, table), rendezvous
    finally:
        stopped = proc.is_alive()  # not killed by the test
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
            conn.send("stop")
            proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert not stopped or proc.exitcode == 0, f"the engine exited with {proc.exitcode}"


def multi_range_batch(table: TargetTable, buffer: torch.Tensor) -> WriteBatch:
    """Ranges of every kind: one over three back-to-back parameters, one inside a
    parameter, a whole parameter, 1500 small ones (more than IOV_MAX) and a large one."""
    addr = {p.name: p.addr for p in table.params}
    base = buffer.data_ptr()
    batch = WriteBatch()
    batch.add(base, addr["a0"], 3000 * 4)
    batch.add(base + 20000, addr["b"] + 10, 100)
    batch.add(base + 30000, addr["c"], 4097)
    for i in range(1500):
        batch.add(base + 40000 + 16 * i, addr["e"] + 4096 * i, 8)
    batch.add(base + (1 << 20), addr["e"] + (7 << 20), 1 << 20)
    return batch


def expected_after(
    table: TargetTable, before: dict[str, torch.Tensor], batch: WriteBatch, buffer: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What the engine must hold after `batch`: every range copied, nothing else changed."""
    after = {n: t.clone() for n, t in before.items()}
    base = buffer.data_ptr()
    for local, remote, length in zip(batch.local, batch.remote, batch.lengths):
        for p in table.params:
            start, end = max(remote, p.addr), min(remote + length, p.addr + p.nbytes)
            if start < end:
                src = local - base + start - remote
                after[p.name][start - p.addr : end - p.addr] = buffer[src : src + end - start]
    return after


def assert_same(held: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert held.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name
