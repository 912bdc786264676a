"""Shards -> full Megatron tensor -> HF tensors: pure tensor functions, no collectives.

Kept apart from the collectives so that the same code computes HF shapes on meta
tensors and the bytes on real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .names import Split

if TYPE_CHECKING:
    import torch


def unshard(shards: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from TP shards in rank order.

    With `stride` s each shard holds s interleaved pieces (Megatron's
    `partition_stride`): the full tensor is piece 0 of every rank, then piece 1 of
    every rank, ... For gated `linear_fc1` (stride 2) that puts all gate rows before
    all up rows.
    """
    import torch

    if len(shards) == 1:
        return shards[0]
    if stride == 1:
        return torch.cat(list(shards), dim)
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([p[i] for i in range(stride) for p in pieces], dim)


@dataclass(frozen=True)
class Heads:
    """Attention geometry needed to split a fused QKV tensor."""

    heads: int
    groups: int
    head_dim: int


def split(full: torch.Tensor, how: Split, heads: Heads | None = None, copies: int = 1) -> tuple[torch.Tensor, ...]:
    """HF tensors of one full Megatron tensor, in the order of the rule's names (`copies` of them
    where the rule repeats it)."""
    if how is Split.COPY:
        return (full,)
    if how is Split.REPEAT:
        return (full,) * copies
    if how is Split.GATE_UP:
        gate, up = full.chunk(2, 0)
        return gate, up
    assert heads is not None, "QKV split needs the attention geometry"
    per_group = heads.heads // heads.groups
    grouped = full.reshape(heads.groups, per_group + 2, heads.head_dim, *full.shape[1:])
    rest = full.shape[1:]
    q = grouped[:, :per_group].reshape(heads.heads * heads.head_dim, *rest)
    k = grouped[:, per_group].reshape(heads.groups * heads.head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(heads.groups * heads.head_dim, *rest)
    return q, k, v
