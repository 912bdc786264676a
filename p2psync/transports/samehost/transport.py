"""Same-host transport: the trainer writes straight into a colocated engine's memory.

On CPU, `process_vm_writev` copies from the trainer's buffers into the engine
process (one copy, no socket, no staging). On GPUs, the engine exports its
parameter memory as CUDA IPC handles and the trainer copies into the mapping
(untested here: no GPU). The device of the exposed tensors selects the path.

Who can reach the engine's memory: no port is opened, but on CPU any process of the
engine's user may write into it (and read it) with process_vm_writev, where Yama allows
(the engine lifts ptrace_scope 1's restriction to ancestors with PR_SET_PTRACER_ANY), and on
GPUs any process that opens the CUDA IPC handles the table publishes. The transport cannot
conceal the memory between updates: the endpoint verifies the weights while it serves
instead (`EngineEndpoint`, `verify_seconds`).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...core.errors import TransferError, where
from ...core.options import NoOptions
from ...core.transport import Peer, Transport, WriteBatch
from ...core.types import TargetTable
from . import cuda_ipc, vm
from .host import allow_ptrace_writes, host_identity, start_time
from ...core.memory import AddressMap, device_of

if TYPE_CHECKING:
    import torch


class SameHostTransport(Transport):
    """Writes into engines on this host; refuses, at connect, engines anywhere else."""

    name = "samehost"
    devices = ("cpu", "cuda")
    Options = NoOptions

    def __init__(self, *, options: Mapping[str, Any] | NoOptions | None = None) -> None:
        super().__init__(options=options)
        self._buffers = AddressMap()  # what CUDA copies read from
        # Nonzero while this engine's memory is exposed; trainers read it before writing, so that
        # they never write into parameters an engine may have freed after closing its transport.
        self._open_word = ctypes.c_uint64(0)

    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        device = device_of(tensors)
        info: dict[str, Any] = {
            "host": host_identity(),
            "pid": os.getpid(),
            "start_time": start_time(os.getpid()),
            "device": device.type,
        }
        if device.type == "cuda":
            info["segments"] = cuda_ipc.export(tensors)
        elif device.type == "cpu":
            allow_ptrace_writes()
            self._open_word.value = secrets.randbits(63) | 1
            info["open_word"] = [ctypes.addressof(self._open_word), self._open_word.value]
        else:
            raise ValueError(f"samehost serves cpu and cuda memory, not {device.type}")
        return info

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._buffers.add(buffer)

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        self._buffers.remove(buffer)

    def open(self, table: TargetTable) -> Peer:
        info = table.transport_info
        who = where(table.engine_id, table.rank)
        here, there = host_identity(), info.get("host", {})
        if (there.get("hostname"), there.get("boot_id")) != (here["hostname"], here["boot_id"]):
            raise TransferError(
                f"{who} runs on host {there.get('hostname')!r} (boot {there.get('boot_id')}), this trainer on "
                f"{here['hostname']!r} (boot {here['boot_id']}): samehost reaches engines on its own host only; "
                "use torchdist, mooncake or nixl across hosts"
            )
        if info.get("device") == "cuda":
            return cuda_ipc.CudaIpcPeer(info["segments"], self._buffers, who, same_process=info["pid"] == os.getpid())
        if there.get("pid_ns") != here["pid_ns"]:
            raise TransferError(
                f"{who} runs in another PID namespace (another container?), where its pid {info.get('pid')} "
                "names another process than here; run trainer and engine in one PID namespace"
            )
        return ProcessPeer(int(info["pid"]), info["start_time"], tuple(info["open_word"]), table, who)

    def close(self) -> None:
        self._open_word.value = 0
        self._buffers = AddressMap()


class ProcessPeer(Peer):
    """process_vm_writev into one engine rank's process, only into the memory it published
    (parameters and patch area)."""

    def __init__(self, pid: int, started: int | None, open_word: tuple[int, int], table: TargetTable, who: str) -> None:
        self.pid = pid
        self.started = started
        self.open_word = open_word
        self.who = who
        spans: list[list[int]] = []
        for addr, nbytes in sorted(table.writable):
            if spans and addr <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], addr + nbytes)
            else:
                spans.append([addr, addr + nbytes])
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]
        self._check_alive()

    def _check_alive(self) -> None:
        """Before each syscall: the pid still is the engine, and the engine still exposes its memory."""
        if start_time(self.pid) != self.started:
            raise TransferError(f"{self.who}: engine process {self.pid} has exited")
        addr, value = self.open_word
        if vm.read_u64(self.pid, addr, who=self.who) != value:
            raise TransferError(f"{self.who}: the engine closed its samehost transport; its parameters may be gone")

    def _check_inside(self, batch: WriteBatch) -> None:
        for remote, length in zip(batch.remote, batch.lengths):
            i = bisect.bisect_right(self._starts, remote) - 1
            if i < 0 or remote + length > self._ends[i]:
                raise TransferError(f"{self.who}: bytes [{remote:#x}, +{length}) are not in the memory it published")

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._check_inside(batch)
        vm.write(self.pid, batch, deadline=deadline, who=self.who, check=self._check_alive)
