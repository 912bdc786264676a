"""Gather-free sends: each trainer rank writes the part of a target that its own shards feed.

A group whose layout says its bytes are copies and constants (`Layout.copy_runs`), and
whose HF tensors every rank of the sender group holds a described part of
(`TrainerSource.local_shards`), is not gathered. At connect, each rank compiles, per
target unit and group, a packing of the runs its shards feed: runs of equal length at a
constant stride in the local data become one strided copy, and runs that continue each
other on the target stay one write however strided their source. At update, the rank
packs its elements, cast to the parameters' dtypes, into a transfer buffer and writes
them. Constants (padding the engine's loader zeroes) are packed by one rank of the sender
group, from bytes computed once at connect. In delta mode each rank keeps the baseline of
its own packings (`Packing.slot`), so its delta memory is its shards' share.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from ..core.layout import Layout, ParamGroup, aligned
from ..core.types import Region, TargetParam

if TYPE_CHECKING:
    import torch

    from ..core.source import LocalShard


@dataclass
class StridedCopy:
    """`count` runs of `length` elements of `source`'s local data, the first at `first` and
    each `stride` after the one before, packed back to back in `dtype` at `buffer_offset`."""

    source: str
    dtype: str
    buffer_offset: int
    first: int
    length: int
    stride: int = 0
    count: int = 1


@dataclass(frozen=True)
class PackedSlot:
    """What a rank's delta baseline of one packing is keyed by: the target bytes it
    holds, in packing order. Equal regions mean equal baseline bytes, whatever shards
    fed them; other regions (a resharded trainer, another layout) start a new baseline."""

    regions: tuple[Region, ...]
    nbytes: int


@dataclass
class Packing:
    """What one rank writes of one group to the targets of one unit: `nbytes` of packed
    bytes, the copies and constants that fill them, and the regions they go to (buffer
    offsets relative to the packing's start)."""

    nbytes: int = 0
    copies: list[StridedCopy] = field(default_factory=list)
    constants: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (buffer offset, bytes)
    regions: list[Region] = field(default_factory=list)

    @cached_property
    def sources(self) -> list[str]:
        """The HF tensors whose local shards this packing reads."""
        return sorted({c.source for c in self.copies})

    @cached_property
    def slot(self) -> PackedSlot:
        """This packing's baseline key (once compiled, its regions do not change)."""
        return PackedSlot(tuple(self.regions), self.nbytes)

    def fill(self, shards: Mapping[str, LocalShard], out: torch.Tensor) -> None:
        """Pack the current values of `shards` into `out` (uint8, at least `nbytes`)."""
        import torch

        for offset, data in self.constants:
            out[offset : offset + data.numel()] = data
        for c in self.copies:
            dtype = getattr(torch, c.dtype)
            src = shards[c.source].data
            runs = src.as_strided((c.count, c.length), (c.stride, 1), src.storage_offset() + c.first)
            nbytes = c.count * c.length * dtype.itemsize
            out[c.buffer_offset : c.buffer_offset + nbytes].view(dtype).view(c.count, c.length).copy_(runs)


def compile_packing(
    layout: Layout,
    group: ParamGroup,
    ranges: Mapping[str, Sequence[tuple[int, int]]],
    params: Mapping[str, TargetParam],
    with_constants: bool,
) -> Packing:
    """The packing of `group` for this rank, whose shards hold `ranges` of the group's
    inputs; with its constants where `with_constants`."""
    import torch

    packing = Packing()
    cursor = 0
    if with_constants and layout.has_constants(group):  # a scratch of the group's size, only where it has any
        scratch = torch.zeros(group.nbytes, dtype=torch.uint8)
        for r in layout.fill_constants(group, scratch):
            packing.constants.append((cursor, scratch[r.buffer_offset : r.buffer_offset + r.nbytes].clone()))
            packing.regions.append(Region(r.param, r.param_offset, cursor, r.nbytes))
            cursor = aligned(cursor + r.nbytes)
    runs = layout.copy_runs(group, ranges)
    assert runs is not None, "compile_packing needs a group of copies"
    local = {name: _LocalIndex(spans) for name, spans in ranges.items()}
    param = None
    for run in runs:
        dtype = params[run.param].dtype
        size = getattr(torch, dtype).itemsize
        if run.param != param:
            param, cursor = run.param, aligned(cursor)
        first, nbytes = local[run.source].of(run.source_offset), run.numel * size
        _extend_regions(packing.regions, Region(run.param, run.param_offset * size, cursor, nbytes))
        last = packing.copies[-1] if packing.copies else None
        if (
            last is not None and last.source == run.source and last.dtype == dtype and last.length == run.numel
            and last.buffer_offset + last.count * last.length * size == cursor
            and (last.count == 1 or first - last.first == last.count * last.stride)
        ):
            if last.count == 1:
                last.stride = first - last.first
            last.count += 1
        else:
            packing.copies.append(StridedCopy(run.source, dtype, cursor, first, run.numel, run.numel))
        cursor += nbytes
    packing.nbytes = aligned(cursor) if cursor else 0
    return packing


def _extend_regions(regions: list[Region], new: Region) -> None:
    """Append `new`, or grow the last region when `new` continues it on both sides."""
    last = regions[-1] if regions else None
    if (
        last is not None and last.param == new.param and last.param_offset + last.nbytes == new.param_offset
        and last.buffer_offset + last.nbytes == new.buffer_offset
    ):
        regions[-1] = Region(last.param, last.param_offset, last.buffer_offset, last.nbytes + new.nbytes)
    else:
        regions.append(new)


class _LocalIndex:
    """Maps a flat element of a full HF tensor to its index in a rank's local data."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        self.starts = [start for start, _ in spans]
        self.ends = [end for _, end in spans]
        self.before = [0]
        for start, end in spans:
            self.before.append(self.before[-1] + end - start)

    def of(self, element: int) -> int:
        i = bisect_right(self.starts, element) - 1
        if i < 0 or element >= self.ends[i]:
            raise ValueError(f"element {element} is not held by this rank")
        return self.before[i] + element - self.starts[i]

