"""TrainerSource for modules sharded with FSDP2's `fully_shard`.

Every rank holds a shard of every parameter, so the sender group is the whole
process group, and a gather is `DTensor.full_tensor()` (an all-gather over the
mesh: gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ...core.rows import all_gather_rows, row_chunk
from ...core.source import LocalShard, TrainerSource
from ...core.types import ParamSpec, SenderGroup

if TYPE_CHECKING:
    import torch

#: Name components that wrappers insert (torch.compile, activation checkpointing,
#: FSDP1, DDP); none of them is part of the HF checkpoint name.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.)")


def hf_name(name: str) -> str:
    """`name` without wrapper components or a leading DDP `module.`."""
    name = _WRAPPER_PARTS.sub(r"\1", name).lstrip(".")
    return name.removeprefix("module.")


class FSDP2Source(TrainerSource):
    """An FSDP2-sharded module. `name_map` renames parameters whose names differ
    from the HF checkpoint's (after wrapper prefixes are stripped); a mapping or
    a function. `select` keeps only the parameters whose name (wrappers stripped, not
    yet renamed) it accepts: a LoRA adapter's tensors, say."""

    name = "fsdp2"
    requires: ClassVar[tuple[str, ...]] = ("torch.distributed.fsdp",)

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name_map: Callable[[str], str] | Mapping[str, str] | None = None,
        select: Callable[[str], bool] | None = None,
        process_group: Any = None,
    ) -> None:
        import torch.distributed as dist

        rename = name_map.get if isinstance(name_map, Mapping) else name_map
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, param in module.named_parameters():
            hf = hf_name(name)
            if select is not None and not select(hf):
                continue
            if rename is not None:
                hf = rename(hf) or hf
            if hf in self._params:
                raise ValueError(f"two parameters map to HF name {hf!r}")
            self._params[hf] = param
        self._group = process_group
        if dist.is_initialized():
            ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
            rank = dist.get_rank()
        else:
            ranks, rank = (0,), 0
        self._sender_group = SenderGroup("fsdp2", ranks, rank)

    def sender_group(self) -> SenderGroup:
        return self._sender_group

    def param_specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in self._params.items()
        ]

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.gather_cast(names, {})

    def gather_cast(self, names: Sequence[str], dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """Parameters sharded on dim 0 over a 1-D mesh (what `fully_shard` makes) are cast
        shard by shard, then gathered with one coalesced all-gather per mesh group and
        dtype: a blocking `full_tensor()` per parameter pays a collective's round trip per
        parameter, much of a bucket's gather time on a MoE model's many expert tensors.
        Not one asynchronous all-gather per parameter: gloo's worker threads drop a
        finished work's tensors just after completing it, and with hundreds in flight a
        drop still pending at interpreter exit aborted a trainer process. Not mixed dtypes
        in one coalesced gloo all-gather either: their bytes came back wrong. Others are
        gathered by `full_tensor()` first, in order, on every rank alike, and cast after."""
        import torch
        from torch.distributed.tensor import DTensor

        def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(getattr(torch, dtypes[name])) if name in dtypes else tensor

        out: dict[str, torch.Tensor] = {}
        packs: dict[tuple[Any, torch.dtype], list[tuple[str, Any, torch.Tensor]]] = {}
        for name in names:
            data = self._params[name].detach()
            if isinstance(data, DTensor) and _dim0_sharded(data):
                local = cast(name, data.to_local())
                packs.setdefault((data.device_mesh.get_group(), local.dtype), []).append((name, data.shape, local))
            else:
                out[name] = cast(name, data.full_tensor() if isinstance(data, DTensor) else data)
        for (group, _), shards in packs.items():
            out.update(all_gather_rows(group, shards))
        return {name: out[name] for name in names}

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """Parameters sharded on dim 0 over a 1-D mesh: this rank's rows, as `torch.chunk`
        splits them (see `core.rows`). Others (replicated, or sharded otherwise) are
        gathered."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name in names:
            data = self._params[name].detach()
            if not (isinstance(data, DTensor) and _dim0_sharded(data)):
                continue
            local = data.to_local()
            first, end = row_chunk(data.shape[0], data.device_mesh.get_local_rank(), data.device_mesh.size())
            if local.shape[0] != end - first or not local.is_contiguous():
                continue  # not torch.chunk's split: leave it to the gather
            per_row = local[0].numel() if local.shape[0] else 0
            ranges = ((first * per_row, end * per_row),) if end > first else ()
            out[name] = LocalShard(ranges, local.reshape(-1))
        return out


def _dim0_sharded(data: Any) -> bool:
    from torch.distributed.tensor import Shard

    return data.device_mesh.ndim == 1 and tuple(data.placements) == (Shard(0),) and data.dim() > 0
