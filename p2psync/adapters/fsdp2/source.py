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
        from torch.distributed.tensor import DTensor

        out = {}
        for name in names:
            param = self._params[name]
            data = param.detach()
            out[name] = data.full_tensor() if isinstance(data, DTensor) else data
        return out
