"""TrainerSource for modules sharded with FSDP2's `fully_shard`.

Every rank holds a shard of every parameter, so the sender group is the whole
process group, and a gather is `DTensor.full_tensor()` (an all-gather over the
mesh: gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...core.source import TrainerSource
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
    a function."""

    name = "fsdp2"
    requires = ("torch.distributed.fsdp",)

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name_map: Callable[[str], str] | Mapping[str, str] | None = None,
        process_group: Any = None,
    ) -> None:
        import torch.distributed as dist

        rename = name_map.get if isinstance(name_map, Mapping) else name_map
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, param in module.named_parameters():
            hf = hf_name(name)
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
        shard by shard, then gathered all at once, one asynchronous all-gather each,
        waited for together: a blocking `full_tensor()` per parameter pays a collective's
        round trip per parameter, much of a bucket's gather time on a MoE model's many
        expert tensors. Others are gathered by `full_tensor()` first, in order, on every
        rank alike, and cast after."""
        import torch
        from torch.distributed.tensor import DTensor

        def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(getattr(torch, dtypes[name])) if name in dtypes else tensor

        out: dict[str, torch.Tensor] = {}
        batched = []
        for name in names:
            data = self._params[name].detach()
            if isinstance(data, DTensor) and _dim0_sharded(data):
                batched.append((name, data))
            else:
                out[name] = cast(name, data.full_tensor() if isinstance(data, DTensor) else data)
        works = []
        for name, data in batched:
            out[name], work = _all_gather_dim0(data, cast(name, data.to_local()))
            works.append(work)
        for work in works:
            work.wait()
        return {name: out[name] for name in names}


def _dim0_sharded(data: Any) -> bool:
    from torch.distributed.tensor import Shard

    return data.device_mesh.ndim == 1 and tuple(data.placements) == (Shard(0),) and data.dim() > 0


def _all_gather_dim0(data: Any, local: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start gathering `local`, this rank's shard of DTensor `data` (sharded on dim 0 as
    `torch.chunk` splits it, FSDP2's sharding: chunks of ceil(rows / world) rows, the
    last ones shorter or empty); return the full tensor (valid once the work is waited
    for) and the work."""
    import torch.distributed as dist

    group = data.device_mesh.get_group()
    world = dist.get_world_size(group)
    rows = data.shape[0]
    chunk = -(-rows // world)
    if local.shape[0] == chunk:
        send = local.contiguous()
    else:
        send = local.new_zeros((chunk, *data.shape[1:]))
        send[: local.shape[0]] = local
    full = send.new_empty((chunk * world, *data.shape[1:]))
    work = dist.all_gather_into_tensor(full, send, group=group, async_op=True)
    return full[:rows], work
