"""An example third-party p2psync plugin.

Registers one class of each kind through the `p2psync` entry-point group
(see pyproject.toml):

- `DictSource`: a single-process trainer whose weights are a dict of full tensors;
- `CopyEngineTarget`: an engine holding each HF tensor whole under its own name;
- `LoopbackTransport`: one-sided writes within one process (memmove), for engines
  that run in the trainer's process.

Its tests (tests/) run p2psync's conformance suite against these classes once the
package is installed, as its authors would: `pip install . && pytest tests`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from p2psync import (
    ConnectError,
    EngineControl,
    EngineTarget,
    Layout,
    ParamGroup,
    ParamSpec,
    PauseMode,
    Peer,
    Region,
    SenderGroup,
    TargetTable,
    TrainerSource,
    TransferError,
    Transport,
    WriteBatch,
    hookimpl,
    where,
)

# -- trainer source -------------------------------------------------------------------------


class DictSource(TrainerSource):
    """A trainer of one process whose HF tensors are the values of a dict."""

    name = "testplugin-dict"

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self.tensors = dict(tensors)

    def sender_group(self) -> SenderGroup:
        return SenderGroup("all", (0,), 0)

    def param_specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in self.tensors.items()
        ]

    def gather(self, names: Sequence[str]) -> dict[str, Any]:
        return {name: self.tensors[name] for name in names}


# -- engine target --------------------------------------------------------------------------


class CopyLayout(Layout):
    """Each engine parameter is the HF tensor of the same name, cast to the engine's dtype."""

    def __init__(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> None:
        for p in table.params:
            spec = sources.get(p.name)
            if spec is None or spec.shape != p.shape:
                raise ConnectError(f"{where(table.engine_id, table.rank, p.name)}: no trainer tensor of that shape")
        self.params = {p.name: p for p in table.params}

    def groups(self) -> Sequence[ParamGroup]:
        return [ParamGroup((p.name,), (p.name,), p.nbytes) for p in self.params.values()]

    def fill(self, group: ParamGroup, tensors: Mapping[str, Any], out: Any) -> list[Region]:
        import torch

        (name,) = group.outputs
        p = self.params[name]
        out[: p.nbytes].view(getattr(torch, p.dtype)).view(p.shape).copy_(tensors[name])
        return [Region(name, 0, 0, p.nbytes)]


class InProcessControl(EngineControl):
    """Control of engines living in this process: nothing to pause; digests read their memory."""

    def __init__(self, tables: Sequence[TargetTable]) -> None:
        self.tables = {t.rank: t for t in tables}
        self.version: str | None = None

    def check_access(self) -> None:
        """The engine lives in this process: nothing to reach."""

    def pause_modes(self) -> tuple[PauseMode, ...]:
        return ("wait",)  # nothing is in flight: nothing to drain

    def pause(self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True) -> None:
        """Nothing serves from these engines while the trainer runs: nothing to stop."""

    def finish(self, version: str) -> None:
        self.version = version

    def digests(self, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        addrs = {p.name: p.addr for p in self.tables[rank].params}
        out = {}
        for name, rs in regions.items():
            h = hashlib.blake2b(digest_size=16)
            for r in rs:
                h.update(ctypes.string_at(addrs[name] + r.param_offset, r.nbytes))
            out[name] = h.hexdigest()
        return out


class CopyEngineTarget(EngineTarget):
    name = "testplugin-copy"
    requires = ("torch",)

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        return CopyLayout(table, sources)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return InProcessControl(tables)


# -- transport ------------------------------------------------------------------------------


def _span(tensor: Any) -> tuple[int, int]:
    if tensor.device.type != "cpu":
        raise TransferError(f"loopback writes host memory only, not {tensor.device}")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _inside(addr: int, length: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= addr and addr + length <= a + n for a, n in ranges)


#: Engine memory exposed in this process and not closed yet: exposure id -> (address, length) ranges.
_EXPOSED: dict[str, list[tuple[int, int]]] = {}


class LoopbackPeer(Peer):
    def __init__(self, transport: LoopbackTransport, exposure: str) -> None:
        self.transport = transport
        self.exposure = exposure

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        regions = _EXPOSED.get(self.exposure)
        if regions is None:
            raise TransferError("the engine side closed its transport: nothing is exposed any more")
        for local, remote, length in zip(batch.local, batch.remote, batch.lengths):
            if not _inside(local, length, list(self.transport.buffers.items())):
                raise TransferError(f"local range {local:#x}+{length} is not in a registered buffer")
            if not _inside(remote, length, regions):
                raise TransferError(f"remote range {remote:#x}+{length} is not exposed")
            ctypes.memmove(remote, local, length)


class LoopbackTransport(Transport):
    """Writes by memmove; trainer and engine must share the process."""

    name = "testplugin-loopback"

    def __init__(self, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options=options)
        self.buffers: dict[int, int] = {}
        self.exposures: list[str] = []

    def expose(self, tensors: Sequence[Any]) -> dict[str, Any]:
        exposure = uuid.uuid4().hex
        _EXPOSED[exposure] = [_span(t) for t in tensors]
        self.exposures.append(exposure)
        return {"pid": os.getpid(), "exposure": exposure}

    def register_buffer(self, buffer: Any) -> None:
        addr, nbytes = _span(buffer)
        self.buffers[addr] = nbytes

    def unregister_buffer(self, buffer: Any) -> None:
        self.buffers.pop(buffer.data_ptr(), None)

    def open(self, table: TargetTable) -> Peer:
        if table.transport_info.get("pid") != os.getpid():
            raise TransferError(f"{where(table.engine_id, table.rank)} lives in another process")
        return LoopbackPeer(self, table.transport_info["exposure"])

    def close(self) -> None:
        self.buffers.clear()
        for exposure in self.exposures:
            _EXPOSED.pop(exposure, None)
        self.exposures.clear()


# -- registration ---------------------------------------------------------------------------


@hookimpl
def p2psync_register_trainer_sources(register: Callable[[type], None]) -> None:
    register(DictSource)


@hookimpl
def p2psync_register_engine_targets(register: Callable[[type], None]) -> None:
    register(CopyEngineTarget)


@hookimpl
def p2psync_register_transports(register: Callable[[type], None]) -> None:
    register(LoopbackTransport)
