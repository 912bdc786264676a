"""`torch.chunk`'s split of a tensor's rows (dim 0) over a group, and the all-gather that
reassembles it.

FSDP2 shards parameters this way (chunks of ceil(rows / world) rows, the last ones shorter
or empty), and `IterableSource` keeps each streamed tensor's rows the same way, so both
declare the same gather-free ranges and gather alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .gloo import all_gather_by_broadcasts, is_gloo

if TYPE_CHECKING:
    import torch


def row_chunk(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [first, end) that `torch.chunk(rows, world)` gives group rank `rank` (empty past the end)."""
    chunk = -(-rows // world)
    first = min(rank * chunk, rows)
    return first, min(first + chunk, rows)


def all_gather_rows(group: Any, shards: list[tuple[str, Any, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Gather (name, full shape, this rank's rows) of tensors split as `row_chunk` splits
    them with one coalesced all-gather (gloo: one broadcast per rank); return the full tensors."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sends = []
    for _, shape, local in shards:
        chunk = -(-shape[0] // world)
        if local.shape[0] == chunk:
            send = local.contiguous()
        else:
            send = local.new_zeros((chunk, *shape[1:]))
            send[: local.shape[0]] = local
        sends.append(send)
    if is_gloo(group):
        return _gathered_by_broadcasts(group, shards, sends)
    fulls = [send.new_empty((send.shape[0] * world, *send.shape[1:])) for send in sends]
    # NCCL runs the recorded all-gathers as one coalesced work. torch 2.13 renamed
    # all_gather_into_tensor (now a deprecated alias, warning at every call) all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with dist._coalescing_manager(group, async_ops=True) as coalesced:
        for full, send in zip(fulls, sends):
            all_gather(full, send, group=group)
    coalesced.wait()
    return {name: full[: shape[0]] for (name, shape, _), full in zip(shards, fulls)}


def _gathered_by_broadcasts(
    group: Any, shards: list[tuple[str, Any, torch.Tensor]], sends: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The same all-gather over gloo as one broadcast of each rank's flat padded shards
    (`core.gloo`); the reassembly is a memcpy."""
    import torch
    import torch.distributed as dist

    mine = torch.cat([send.reshape(-1) for send in sends])
    flats = [mine if r == dist.get_rank() else torch.empty_like(mine) for r in dist.get_process_group_ranks(group)]
    all_gather_by_broadcasts(flats, group)
    out, offset = {}, 0
    for (name, shape, _), send in zip(shards, sends):
        n = send.numel()
        full = torch.cat([flat[offset : offset + n].view(send.shape) for flat in flats])
        out[name] = full[: shape[0]]
        offset += n
    return out
