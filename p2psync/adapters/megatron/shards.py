"""Where a rank's shard of one Megatron tensor lands in the HF tensors it becomes, and which
rank claims a part that several hold: index arithmetic, no collectives, for gather-free sends.

It describes, in closed form, the same conversion that `convert.unshard` and `convert.split`
compute on gathered tensors (and that the tests check it against): TP pieces along
`partition_dim` with Megatron's `partition_stride`, then the rows of the full tensor split
into HF tensors (fused QKV per query group, stacked gate/up), then the vocabulary padding
dropped. The result, per HF tensor, is the flat element ranges this rank holds and where
their values start in the rank's flat local tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from .convert import Heads
from .names import Split

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sharding:
    """How a local tensor sits in its full Megatron tensor: `size` ranks each hold `stride`
    equal pieces along `dim`; the full tensor is piece 0 of every rank, then piece 1, ...
    (`convert.unshard`). This rank is `rank`. A replicated tensor is `Sharding()`."""

    dim: int = 0
    stride: int = 1
    size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class Placed:
    """One HF tensor's part held by this rank: `ranges` ([start, end) flat elements of the HF
    tensor, ascending) whose values lie in the rank's flat local tensor at `slices`
    ((start, length), in the same order, back to back)."""

    ranges: tuple[tuple[int, int], ...]
    slices: tuple[tuple[int, int], ...]

    @staticmethod
    def nothing() -> Placed:
        return Placed((), ())

    def values(self, local: torch.Tensor) -> torch.Tensor:
        """This part's values from the rank's local tensor: a view where they are one slice of it,
        a copy where they are several (the q, k or v rows of a fused QKV shard)."""
        import torch

        flat = local.reshape(-1)
        parts = [flat[start : start + n] for start, n in self.slices]
        return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else flat[:0]


def claims(index: int, split: bool, tp_rank: int, tp_size: int, replica: int, replicas: int) -> bool:
    """Whether this rank claims its copy of the sender group's `index`-th tensor, which
    `replicas` ranks (DP x CP, or expert DP) hold alike per TP rank, and, where TP does not
    split it (`split` False), every TP rank of each replica too. The `index`-th tensor goes
    to copy `index` mod their number: the same answer on every rank, exactly one claimer
    per part, and the writes spread over every rank instead of one replica's."""
    if split:
        return replica == index % replicas
    return (replica, tp_rank) == divmod(index % (replicas * tp_size), tp_size)


def place(
    shape: Sequence[int], sharding: Sharding, how: Split, heads: Heads | None, rows: Sequence[int]
) -> list[Placed] | None:
    """Per HF tensor of the rule (in its order), what a local tensor of `shape` holds of it;
    `rows[i]`: the rows the i-th HF tensor keeps (fewer than the full tensor gives where the
    vocabulary is padded). None where the conversion is not described here (split along a
    dimension other than 0 or 1, a fused tensor split along 1, shapes that do not divide):
    that tensor is gathered."""
    if how is Split.REPEAT:
        once = place(shape, sharding, Split.COPY, heads, rows[:1])
        return None if once is None else once * len(rows)
    if not shape or sharding.dim not in (0, 1) or shape[sharding.dim] % sharding.stride:
        return None
    if sharding.dim == 1:
        return _columns(shape, sharding, rows) if how is Split.COPY and len(shape) == 2 else None
    full = shape[0] * sharding.size
    if how is Split.QKV and (
        heads is None or heads.heads % heads.groups or full != (heads.heads + 2 * heads.groups) * heads.head_dim
    ):
        return None
    if how is Split.GATE_UP and full % 2:
        return None
    width = prod(shape[1:])
    outputs = 3 if how is Split.QKV else 2 if how is Split.GATE_UP else 1
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in range(outputs)]  # (HF row, local row, rows)
    piece = shape[0] // sharding.stride
    for i in range(sharding.stride):
        start = i * piece * sharding.size + sharding.rank * piece  # this piece's first row of the full tensor
        for out, hf_row, offset, n in _hf_rows(how, heads, full, start, piece):
            n = min(n, rows[out] - hf_row)
            if n > 0:
                blocks[out].append((hf_row, i * piece + offset, n))
    return [_placed(sorted(b), width) for b in blocks]


def _hf_rows(how: Split, heads: Heads | None, full: int, start: int, n: int) -> Iterator[tuple[int, int, int, int]]:
    """Rows [start, start + n) of the full Megatron tensor as (HF tensor, its first row, offset in
    the block, rows): cut where they change HF tensor (`convert.split`)."""
    if how is Split.COPY:
        yield 0, start, 0, n
        return
    end, pos = start + n, start
    while pos < end:
        if how is Split.GATE_UP:
            half = full // 2
            out, first, stop = (0, pos, half) if pos < half else (1, pos - half, full)
        else:
            assert heads is not None
            per_group, dim = heads.heads // heads.groups, heads.head_dim
            size = (per_group + 2) * dim  # one query group: its q heads, then its k head, then its v head
            group, within = divmod(pos, size)
            base = group * size
            if within < per_group * dim:
                out, first, stop = 0, group * per_group * dim + within, base + per_group * dim
            elif within < (per_group + 1) * dim:
                out, first, stop = 1, group * dim + within - per_group * dim, base + (per_group + 1) * dim
            else:
                out, first, stop = 2, group * dim + within - (per_group + 1) * dim, base + size
        stop = min(stop, end)
        yield out, first, pos - start, stop - pos
        pos = stop


def _placed(blocks: list[tuple[int, int, int]], width: int) -> Placed:
    """Row blocks (HF row, local row, rows), ascending in HF rows, as element ranges and local
    slices; blocks that continue each other on both sides merge."""
    merged: list[list[int]] = []
    for hf_row, local_row, n in blocks:
        if merged and merged[-1][0] + merged[-1][2] == hf_row and merged[-1][1] + merged[-1][2] == local_row:
            merged[-1][2] += n
        else:
            merged.append([hf_row, local_row, n])
    return Placed(
        tuple((h * width, (h + n) * width) for h, _, n in merged),
        _joined(tuple((lr * width, n * width) for _, lr, n in merged)),
    )


def _columns(shape: Sequence[int], sharding: Sharding, rows: Sequence[int]) -> list[Placed]:
    """A 2-D tensor split along its columns (a row-parallel linear): per row, one range per piece."""
    local_rows, cols = shape
    piece, full_cols = cols // sharding.stride, cols * sharding.size
    kept = min(local_rows, rows[0])
    ranges: list[tuple[int, int]] = []
    for row in range(kept):
        for i in range(sharding.stride):
            start = row * full_cols + i * piece * sharding.size + sharding.rank * piece
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + piece)
            else:
                ranges.append((start, start + piece))
    return [Placed(tuple(ranges), ((0, kept * cols),) if kept * cols else ())]


def _joined(slices: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Local slices that follow each other, as one."""
    out: list[tuple[int, int]] = []
    for start, n in slices:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return tuple(out)
