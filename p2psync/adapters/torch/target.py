"""Trainer side of the torch engine: the identity layout and the endpoint control client.

A torch engine holds each HF tensor whole, under its HF name, in its own dtype:
its bytes are the trainer's tensor cast to that dtype, as `param.copy_(hf)` would
write them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ...engine.endpoint import EndpointControl
from ...core.engine import EngineControl, EngineTarget
from ...core.errors import ConnectError, where
from ...core.layout import CopyRun, Layout, ParamGroup
from ...core.types import ParamSpec, Region, TargetParam, TargetTable

if TYPE_CHECKING:
    import torch


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


class IdentityLayout(Layout):
    """One group per parameter: the HF tensor of the same name, cast to the engine's dtype."""

    def __init__(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> None:
        problems = []
        for p in table.params:
            spec = sources.get(p.name)
            if spec is None:
                problems.append(f"{where(table.engine_id, table.rank, p.name)}: the trainer has no such HF tensor")
            elif spec.shape != p.shape:
                problems.append(
                    f"{where(table.engine_id, table.rank, p.name)}: shape {list(p.shape)} on the engine, "
                    f"{list(spec.shape)} on the trainer"
                )
            elif _is_float(spec.dtype) != _is_float(p.dtype):
                # float -> float casts are what the engine's own `param.copy_` does; anything else is a mix-up
                problems.append(
                    f"{where(table.engine_id, table.rank, p.name)}: dtype {p.dtype} on the engine, "
                    f"{spec.dtype} on the trainer"
                )
        extra = sorted(set(sources) - {p.name for p in table.params})
        if extra:
            problems.append(
                f"{where(table.engine_id, table.rank)}: no parameter for trainer HF tensors {extra[:5]}"
                + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            )
        if problems:
            raise ConnectError("; ".join(problems))
        self._params: dict[str, TargetParam] = {p.name: p for p in table.params}
        self._groups = [ParamGroup((p.name,), (p.name,), p.nbytes) for p in table.params]

    def groups(self) -> Sequence[ParamGroup]:
        return self._groups

    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        import torch

        (name,) = group.outputs
        param = self._params[name]
        out[: param.nbytes].view(getattr(torch, param.dtype)).view(param.shape).copy_(tensors[name])
        return [Region(name, 0, 0, param.nbytes)]

    def copy_runs(self, group: ParamGroup, held: Mapping[str, Sequence[tuple[int, int]]]) -> list[CopyRun]:
        (name,) = group.outputs
        return [CopyRun(name, start, name, start, end - start) for start, end in held.get(name, ()) if end > start]

    def has_constants(self, group: ParamGroup) -> bool:
        return False


class TorchEngineTarget(EngineTarget):
    """Engines that run `p2psync.adapters.torch.serve` in each rank."""

    name = "torch"
    requires = ("torch",)

    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        return IdentityLayout(table, sources)

    def control(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> EngineControl:
        return EndpointControl(tables, timeout=timeout, token=token)
