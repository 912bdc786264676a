"""Mooncake Transfer Engine: one-sided writes over TCP here, RDMA where the hardware is.

Uses the P2P handshake (no metadata server): the engine side publishes
`"<host>:<rpc_port>"` as its session name. The non-CUDA wheel
(`mooncake-transfer-engine-non-cuda`) registers host memory only; GPU memory
needs the CUDA wheel, which registers device pointers through the same calls
(not runnable on the CPU machines this project is tested on).

Who can reach the engine's memory: Mooncake listens on every interface (its handshake
port and its TCP data port bind INADDR_ANY / in6addr_any, whatever host `initialize` is
given; $MC_TCP_BIND_ADDRESS only names the address it advertises without the P2P
handshake) and asks for no credentials: any process that reaches those ports and knows an
address (the tables in the rendezvous list them) may write and read whatever is
registered. Its TCP transport refuses a remote address outside every registered buffer,
and RDMA keys die with their registration, so the engine side registers its memory only
while an update holds it paused (`conceal`, option `conceal`): outside updates Mooncake
refuses every remote write and read of it. During an update, whoever reaches the ports may
write too, as the trainer does (`check=True` catches such bytes where they land before the
digests are taken).
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...core.errors import TransferError
from ...core.transport import Peer, Transport, WriteBatch
from ...core.types import TargetTable
from .pacing import WirePace
from .startup import StartupFailed, initialize_quietly

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: How often to start a Transfer Engine that lost a port race (see `MooncakeTransport.engine`):
#: 8 were not always enough for 8 engines starting at once on a host whose 15000-17000 range
#: many earlier connections had left in TIME_WAIT (the chaos test's, run just before).
BIND_ATTEMPTS = 20
#: What Mooncake says when another process took the port it picked.
PORT_RACE = re.compile(r"Address already in use|unable to find available tcp port")


def _said(lines: list[str]) -> str:
    """What Mooncake printed, for an error message."""
    return ("; Mooncake said: " + " | ".join(lines[-5:])) if lines else ""


def _lost_port_race(failure: str, said: list[str]) -> bool:
    """Whether a failed start lost a port to another process starting at the same time."""
    return any(PORT_RACE.search(line) for line in [failure, *said])


def rdma_devices() -> list[str]:
    """RDMA devices the kernel knows of (empty on machines without an HCA)."""
    path = Path("/sys/class/infiniband")
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


@dataclass(frozen=True)
class MooncakeOptions:
    """`host`: the address peers reach this process at (default: `core.host.local_host`:
    $P2PSYNC_HOST, the Ray node's address, or the route toward the rendezvous);
    `protocol`: Mooncake's ("auto": rdma when an RDMA device exists, else tcp);
    `device_name`: RDMA devices ("" = all); `log_level`: Mooncake's own (default WARNING:
    its INFO level logs every batch; $MC_LOG_LEVEL wins when set); `conceal`: on the engine
    side, register the memory with Mooncake only while an update holds the engine paused, so
    that outside updates Mooncake refuses every remote write and read of it (True; False keeps
    it registered from start to close; "auto", the default: over TCP, not over RDMA, where
    registering GPU memory costs more per update and new registrations give new keys, which
    this project cannot test: there the endpoint watches the weights instead). Mooncake 0.3.13
    copies its list of registrations at each one, so registering n ranges costs O(n^2):
    measured over TCP here, 2 ms for 300 ranges, 0.1-0.2 s for 1000-3000, 13 s for 10000 per
    pause; adjacent tensors are registered as one range."""

    host: str | None = None
    protocol: str = "auto"
    device_name: str = ""
    log_level: str = "WARNING"
    conceal: bool | Literal["auto"] = "auto"


class MooncakeTransport(Transport):
    """Mooncake Transfer Engine; options: `MooncakeOptions`."""

    name = "mooncake"
    requires = ("mooncake.engine",)
    # Device memory needs the CUDA wheel (`mooncake-transfer-engine`, extra `mooncake-cuda`).
    devices = ("cpu", "cuda")
    Options = MooncakeOptions

    def __init__(self, *, options: Mapping[str, Any] | MooncakeOptions | None = None) -> None:
        super().__init__(options=options)
        requested = self.options.protocol
        devices = rdma_devices()
        if requested == "auto":
            self.protocol = "rdma" if devices else "tcp"
        elif requested == "rdma" and not devices:
            # Mooncake would say yes and silently fall back to TCP: say what really happens.
            log.warning("protocol rdma requested but no RDMA device found; Mooncake will use TCP")
            self.protocol = "tcp"
        else:
            self.protocol = requested
        self.device_name = self.options.device_name
        conceal = self.options.conceal
        self.conceals = self.protocol == "tcp" if conceal == "auto" else bool(conceal)
        self._engine: Any = None
        self._registered: dict[int, int] = {}  # address -> bytes

    @property
    def host(self) -> str:
        """The address peers reach this process at (see `Transport.local_host`)."""
        return self.local_host(self.options.host)

    @property
    def registered_bytes(self) -> int:
        """Bytes of memory this transport has registered with Mooncake now."""
        return sum(self._registered.values())

    @property
    def engine(self) -> Any:
        """This process's Transfer Engine, started on first use.

        Mooncake picks its TCP data port at random (15000-17000), checks that it is
        free, closes the check socket and binds it again moments later: processes
        starting at once on one host can take each other's port in between. The loser's
        `initialize` raises "bind: Address already in use", or returns -1 after "unable to
        find available tcp port" when every port it tried was taken. A fresh engine picks
        fresh ports, so either is retried, after a random pause that grows with each attempt
        (processes that raced once would otherwise race again in step)."""
        if self._engine is None:
            os.environ.setdefault("MC_LOG_LEVEL", self.options.log_level)
            from mooncake.engine import TransferEngine

            start = f"Mooncake initialize({self.host!r}, protocol {self.protocol!r})"
            cause: RuntimeError | None
            for attempt in range(1, BIND_ATTEMPTS + 1):
                engine = TransferEngine()
                try:
                    rc, said = initialize_quietly(
                        lambda: engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.device_name)
                    )
                except StartupFailed as failed:
                    if not isinstance(failed.cause, RuntimeError):
                        raise failed.cause from None
                    failure, said, cause = f"failed: {failed}", failed.said, failed.cause
                else:
                    if rc == 0:
                        self._engine = engine
                        break
                    failure, cause = f"returned {rc}", None
                if not _lost_port_race(failure, said) or attempt == BIND_ATTEMPTS:
                    raise TransferError(f"{start} {failure} (attempt {attempt})" + _said(said)) from cause
                log.info("Mooncake lost a port race (%s); starting again on fresh ports", failure)
                del engine
                time.sleep(random.uniform(0, 0.05 * attempt))  # out of step with the processes it raced
        return self._engine

    def _register(self, addr: int, nbytes: int) -> None:
        if self._registered.get(addr) == nbytes:
            return
        rc = self.engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({addr:#x}, {nbytes}) returned {rc}")
        self._registered[addr] = nbytes

    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Register `tensors` (again, after `conceal`): the session name stays."""
        for addr, nbytes in spans(tensors):
            self._register(addr, nbytes)
        return {"session": f"{self.host}:{self.engine.get_rpc_port()}", "protocol": self.protocol}

    def conceal(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Unregister `tensors`: Mooncake refuses remote writes and reads of memory it holds
        no registration of (its TCP server checks every remote address against them). False
        where option `conceal` says not to (they stay registered)."""
        if not self.conceals:
            return False
        for addr, _ in spans(tensors):
            if self._registered.pop(addr, None) is not None:
                rc = self.engine.unregister_memory(addr)
                if rc != 0:
                    raise TransferError(f"Mooncake unregister_memory({addr:#x}) returned {rc}")
        return True

    def fence(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Drop the Transfer Engine, whose destruction closes every connection it accepted (a
        stalled one would otherwise write into `tensors` once it resumes, whenever that is),
        and expose them through a new one, on new ports."""
        self.close()
        return self.expose(tensors)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._register(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        addr = buffer.data_ptr()
        if self._registered.pop(addr, None) is not None:
            self.engine.unregister_memory(addr)

    def open(self, table: TargetTable) -> Peer:
        session = table.transport_info.get("session")
        if not isinstance(session, str) or ":" not in session:
            raise TransferError(f"engine {table.engine_id!r} rank {table.rank} published no Mooncake session name")
        return MooncakePeer(self.engine, session)

    def close(self) -> None:
        """Unregister everything and drop the Transfer Engine, whose destruction stops its
        threads and closes its ports (it takes Mooncake about a second)."""
        if self._engine is not None:
            for addr in self._registered:
                self._engine.unregister_memory(addr)
        self._registered = {}
        self._engine = None

    def describe(self) -> dict[str, Any]:
        return {"transport": self.name, "protocol": self.protocol, "rdma_devices": rdma_devices()}


def spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The memory of `tensors` as (address, bytes) ranges, tensors that sit back to back (or
    share memory) merged into one (Mooncake refuses overlapping registrations, and they cost
    more the more there are), none of zero bytes."""
    merged: list[list[int]] = []
    for addr, nbytes in sorted((t.data_ptr(), t.numel() * t.element_size()) for t in tensors):
        if nbytes <= 0:
            continue
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][0] + merged[-1][1], addr + nbytes) - merged[-1][0]
        else:
            merged.append([addr, nbytes])
    return [(addr, nbytes) for addr, nbytes in merged]


class MooncakePeer(Peer):
    """Batched asynchronous writes to one engine rank, slept through (`WirePace`) and then
    waited for until done or late."""

    def __init__(self, engine: Any, session: str) -> None:
        self.engine = engine
        self.session = session
        self.pace = WirePace()

    def close(self) -> None:
        """Drop the Transfer Engine: once the transport drops it too it is destroyed then, with
        its threads, not in the interpreter's teardown (where it ends the process by SIGABRT)."""
        self.engine = None

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        """Submit the batch, sleep through most of its expected wire time (`WirePace`), then
        wait for it. `get_batch_transfer_status` waits inside Mooncake until the batch landed,
        failed or passed Mooncake's own timeout, spinning its thread's core all the while;
        `transfer_check_status`, which returns at once, looks at a batch's first write only
        (Mooncake 0.3.13: 1672 of 2048 rows not yet written when it said done), so it cannot
        be used. `timeout` is therefore kept by the writer: it gives up on a write that overran
        it (`EngineWriter.wait`), and the next update writes through a new thread
        (`EngineWriter.successor`)."""
        if not batch.lengths:
            return
        engine = self.engine  # `close` may drop it while a write is still in here
        batch_id = engine.batch_transfer_async_write(self.session, batch.local, batch.remote, batch.lengths)
        if batch_id == 0:
            raise TransferError(f"Mooncake could not start a write to {self.session}")
        slept = self.pace.sleep_before_wait(batch.nbytes, timeout)
        if slept:
            time.sleep(slept)
        waited = time.monotonic()
        status = engine.get_batch_transfer_status([batch_id])
        self.pace.observe(batch.nbytes, slept, time.monotonic() - waited)
        if status != 0:
            raise TransferError(f"Mooncake write of {batch.nbytes} bytes to {self.session} failed (status {status})")
