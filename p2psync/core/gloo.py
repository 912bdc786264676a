"""An all-gather for the trainer sources on gloo: one broadcast per rank.

Over loopback TCP, gloo's all-gather moved 0.73 GB/s where its broadcasts of the same
bytes moved 2.5 GB/s (2 ranks, 112 MB), so the sources gather that way on gloo; NCCL keeps
its all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_gloo(group: Any) -> bool:
    import torch.distributed as dist

    return bool(dist.get_backend(group) == "gloo")


def all_gather_by_broadcasts(buffers: Sequence[torch.Tensor], group: Any) -> None:
    """Fill `buffers` (one per rank of `group`, in rank order; this rank's holds its own part)
    with every rank's part."""
    import torch.distributed as dist

    for rank, buffer in zip(dist.get_process_group_ranks(group), buffers):
        dist.broadcast(buffer, src=rank, group=group)
