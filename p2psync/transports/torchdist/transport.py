"""torch.distributed point to point: gloo on CPU, NCCL on GPUs, one two-rank group per pair.

A two-sided transport: the engine side receives on threads of its own (see
receiver.py) into its parameter memory, in the order the trainer sends, and
acknowledges each write, so `Peer.write` returns once the bytes have landed.
The NCCL path is UNTESTED (no GPU on this project's machines).

Who can reach the engine's memory: gloo's sockets listen on `host` only (the address peers
use), but pairs meet through the rendezvous store, which any process that reaches it may
read and write: such a process may ask for a pair on the published channel and send writes,
with no token. Outside updates the receiver refuses every write (`conceal`: its pair closes,
none of its bytes lands); during an update, whoever asks for a pair may write too. Nothing is
ever read back from the engine. NCCL's own sockets are NCCL's (`NCCL_SOCKET_IFNAME`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.errors import TransferError, TransferTimeout, where
from ...core.transport import Peer, Transport, WriteBatch
from ...core.types import TargetTable
from ...core.memory import AddressMap, device_of
from .pair import ENGINE, TAG, TRAINER, Pair, channel_key, own_connection
from .receiver import Receiver

if TYPE_CHECKING:
    import torch

    from ...core.rendezvous import Rendezvous


@dataclass(frozen=True)
class TorchDistOptions:
    """`host`: the address this process's gloo sockets bind to (default: `core.host.local_host`:
    $P2PSYNC_HOST, the Ray node's address, or the route toward the rendezvous);
    `connect_timeout`: seconds (default: the rendezvous's timeout)."""

    host: str | None = None
    connect_timeout: float | None = None


class TorchDistTransport(Transport):
    """torch.distributed point to point; options: `TorchDistOptions`."""

    name = "torchdist"
    devices = ("cpu", "cuda")
    Options = TorchDistOptions

    def __init__(self, *, options: Mapping[str, Any] | TorchDistOptions | None = None) -> None:
        super().__init__(options=options)
        self._buffers = AddressMap()
        self._receiver: Receiver | None = None
        self._info: dict[str, Any] = {}

    def _bound(self) -> Rendezvous:
        if self.rendezvous is None:
            raise TransferError("the torchdist transport builds its groups in the rendezvous: call bind() first")
        return self.rendezvous

    @property
    def host(self) -> str:
        """The address peers reach this process at (see `Transport.local_host`)."""
        return self.local_host(self.options.host)

    @property
    def connect_timeout(self) -> float:
        return float(self.options.connect_timeout or self._bound().timeout)

    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Start receiving into `tensors` on a new channel; again after `conceal`, take writes
        again on the same one."""
        if self._receiver is not None:
            self._receiver.concealed = False
            return self._info
        device = device_of(tensors)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"torchdist receives into cpu (gloo) or cuda (NCCL) memory, not {device.type}")
        channel = uuid.uuid4().hex
        self._receiver = Receiver(
            self._bound().store, channel, AddressMap(tensors), device, host=self.host, timeout=self.connect_timeout
        )
        self._receiver.start()
        self._info = {"channel": channel, "device": device.type}
        return self._info

    def conceal(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Refuse every write until `expose` is called again (see the module's docstring)."""
        if self._receiver is None:
            return False
        self._receiver.concealed = True
        return True

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._buffers.add(buffer)

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        self._buffers.remove(buffer)

    def open(self, table: TargetTable) -> Peer:
        channel = table.transport_info.get("channel")
        if not isinstance(channel, str):
            raise TransferError(f"{where(table.engine_id, table.rank)} published no torchdist channel")
        return TorchDistPeer(self, table, channel, str(table.transport_info.get("device", "cpu")))

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        self._buffers = AddressMap()

    def describe(self) -> dict[str, Any]:
        return {"transport": self.name, "host": self.host}


def _send_device(engine_device: str) -> torch.device:
    import torch

    if engine_device != "cuda":
        return torch.device("cpu")
    # UNTESTED (no GPU here).
    if not torch.cuda.is_available():
        raise TransferError("the engine's parameters are on a GPU (NCCL), but this trainer process has no CUDA")
    return torch.device("cuda", torch.cuda.current_device())


class TorchDistPeer(Peer):
    """Sends to one engine rank over a pair of its own; reconnects after a failure."""

    def __init__(self, transport: TorchDistTransport, table: TargetTable, channel: str, device: str) -> None:
        self.transport = transport
        self.channel = channel
        self.device = device
        self.who = where(table.engine_id, table.rank)
        self.sender = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # the engine keys pairs by it
        # Where the bytes leave from: host memory for gloo; for NCCL this rank's GPU, read here because the
        # writer threads that call write() do not inherit the caller's current device.
        self.send_device = _send_device(device)
        # Its own store connection, used by one thread at a time: open(), then write() on a writer thread.
        self._store = own_connection(transport._bound().store)
        self._lock = threading.Lock()
        self._pair: Pair | None = self._connect(time.monotonic() + transport.connect_timeout)

    def _connect(self, deadline: float) -> Pair:
        import torch.distributed as dist

        n = self._store.add(channel_key(self.channel, "requests"), 1)
        self._store.set(channel_key(self.channel, f"request/{n}"), self.sender)
        timeout = max(deadline - time.monotonic(), 1e-3)
        try:
            return Pair.connect(
                dist.PrefixStore(channel_key(self.channel, f"pair/{n}/"), self._store),
                TRAINER,
                host=self.transport.host,
                timeout=timeout,
                nccl=self.device == "cuda",
            )
        except RuntimeError as exc:
            raise TransferError(f"{self.who}: no torchdist connection within {timeout:.1f} s: {exc}") from exc

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        if not batch.lengths:
            return
        deadline = time.monotonic() + timeout
        sources = self._sources(batch)
        with self._lock:
            if self._pair is None:
                self._pair = self._connect(deadline)
            try:
                self._send(self._pair, batch, sources, deadline)
            except TimeoutError as exc:
                self.close()
                raise TransferTimeout(
                    f"{self.who}: torchdist write of {batch.nbytes} bytes not done after {timeout:.1f} s"
                ) from exc
            except (RuntimeError, TransferError) as exc:
                self.close()
                raise TransferError(f"{self.who}: torchdist write of {batch.nbytes} bytes failed: {exc}") from exc

    def _sources(self, batch: WriteBatch) -> list[torch.Tensor]:
        """What `batch` reads from the transfer buffers, on the device the bytes leave
        from: (pinned) host buffers are staged on this rank's GPU for NCCL."""
        try:
            views = [self.transport._buffers.view(a, n) for a, n in zip(batch.local, batch.lengths)]
        except ValueError as exc:
            raise TransferError(f"{self.who}: a range is not in a registered transfer buffer: {exc}") from exc
        to_gpu = self.send_device.type == "cuda"  # the NCCL stream waits for these copies; gloo must not
        return [view.to(self.send_device, non_blocking=to_gpu) for view in views]

    def _send(self, pair: Pair, batch: WriteBatch, sources: list[torch.Tensor], deadline: float) -> None:
        import torch

        left_ms = int((deadline - time.monotonic()) * 1000)
        works = [
            pair.control.send([torch.tensor([len(batch), left_ms], dtype=torch.int64)], ENGINE, TAG),
            pair.control.send([torch.tensor(batch.remote + batch.lengths, dtype=torch.int64)], ENGINE, TAG),
        ]
        works += [pair.data.send([source], ENGINE, TAG) for source in sources]
        ack = torch.zeros(1, dtype=torch.int64)
        works.append(pair.control.recv([ack], ENGINE, TAG))
        for work in works:
            pair.wait(work, deadline)
        if ack.item() != batch.nbytes:
            raise TransferError(f"the engine acknowledged {ack.item()} bytes of {batch.nbytes}")

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None
