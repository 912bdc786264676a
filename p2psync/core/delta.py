"""Lossless delta encoding of parameter bytes: the wire format of a patch and its encoder.

Between two RL steps most elements of a bf16 or fp8 parameter keep their bytes. A
region's new bytes are compared with the bytes the target holds (the sender's
baseline) element by element, at the parameter's element size, as raw bits (so
NaNs and signed zeros compare exactly), and go out as the cheapest of:

- *dense*: every byte of the region, written straight into the parameter as in a
  full update;
- *bitmap*: one bit per element (set: changed; element i is bit i % 8 of byte i // 8,
  least significant bit first), then the changed elements' new bytes in element order;
- *index*: the changed elements' int32 indices, ascending, then their new bytes in
  that order.

The sparse forms are staged into the engine's patch area; a `PatchRecord` (sent
with the control call that asks the engine to apply them) says where each lies and
which parameter bytes it patches. Both pieces of a record start 8-byte aligned, so
that the engine can view them in place as int32 indices and as elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Kind = Literal["bitmap", "index"]
KINDS: tuple[Kind, ...] = ("bitmap", "index")
#: Element sizes compared as one unit (uint8, int16, int32, int64 views).
ELEMENT_SIZES = (1, 2, 4, 8)
#: Alignment of each piece of a record in the patch area.
PIECE_ALIGN = 8
#: What a sparse record costs besides its pieces (its entry in the apply call):
#: a region whose sparse form saves less than this goes dense.
RECORD_OVERHEAD = 64
INDEX_BYTES = 4
#: Elements one record covers at most: its indices must fit in int32.
MAX_RECORD_ELEMENTS = 2**31 - 1


def piece(nbytes: int) -> int:
    """`nbytes` rounded up to PIECE_ALIGN."""
    return (nbytes + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN


def meta_bytes(kind: Kind, count: int, changed: int) -> int:
    """Bytes of a record's bitmap or index list."""
    return (count + 7) // 8 if kind == "bitmap" else changed * INDEX_BYTES


def record_bytes(kind: Kind, count: int, changed: int, elem_size: int) -> int:
    """Bytes a record occupies in the patch area (both pieces, aligned)."""
    return piece(meta_bytes(kind, count, changed)) + piece(changed * elem_size)


def cheapest(count: int, changed: int, elem_size: int) -> Kind | Literal["dense"]:
    """The smallest way to send `changed` of `count` elements; dense on a tie, since it
    costs the engine nothing to apply."""
    dense = count * elem_size
    kind = min(KINDS, key=lambda k: record_bytes(k, count, changed, elem_size))
    return kind if record_bytes(kind, count, changed, elem_size) + RECORD_OVERHEAD < dense else "dense"


@dataclass(frozen=True)
class PatchRecord:
    """One sparse patch of `count` elements of `param`, starting at byte `param_offset`.

    `meta_offset` (bitmap or indices) and `values_offset` (the `changed` new elements,
    `elem_size` bytes each) are byte offsets in the engine's patch area.
    """

    param: str
    param_offset: int
    elem_size: int
    count: int
    changed: int
    kind: Kind
    meta_offset: int
    values_offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the region it patches."""
        return self.count * self.elem_size

    @property
    def end(self) -> int:
        """One past the last patch-area byte it reads."""
        return max(
            self.meta_offset + meta_bytes(self.kind, self.count, self.changed),
            self.values_offset + self.changed * self.elem_size,
        )

    def to_wire(self) -> list[object]:
        return [
            self.param, self.param_offset, self.elem_size, self.count, self.changed, self.kind,
            self.meta_offset, self.values_offset,
        ]

    @classmethod
    def from_wire(cls, row: object) -> PatchRecord:
        """Parse one record of an apply call; ValueError if it is malformed."""
        if not isinstance(row, list) or len(row) != 8:
            raise ValueError(f"a patch record is a list of 8 fields, got {row!r}")
        param, kind = row[0], row[5]
        numbers = [row[i] for i in (1, 2, 3, 4, 6, 7)]
        if not isinstance(param, str) or kind not in KINDS or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers
        ):
            raise ValueError(f"malformed patch record {row!r}")
        param_offset, elem_size, count, changed, meta_offset, values_offset = numbers
        return cls(param, param_offset, elem_size, count, changed, kind, meta_offset, values_offset)


@dataclass
class Change:
    """How one region goes out: `kind` dense, or a sparse form with its two pieces as
    uint8 tensors (`meta`: bitmap or int32 indices; `values`: the changed elements) and
    `where` the changed elements' indices (int64, on the compared memory's side)."""

    kind: Kind | Literal["dense"]
    count: int
    changed: int
    meta: torch.Tensor | None = None
    values: torch.Tensor | None = None
    where: Any = None


def element_size_for(elem_size: int, *offsets: int) -> int:
    """`elem_size` if every offset (byte positions and lengths) is a multiple of it, so the
    bytes can be viewed as elements in place; else 1 (compare byte by byte)."""
    if elem_size in ELEMENT_SIZES and all(o % elem_size == 0 for o in offsets):
        return elem_size
    return 1


def elements(data: torch.Tensor, elem_size: int) -> torch.Tensor:
    """A uint8 tensor's bytes as integers of `elem_size` bytes (no copy)."""
    import torch

    return data.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[elem_size])


def diff(new: torch.Tensor, old: torch.Tensor, elem_size: int) -> Change | None:
    """How the bytes `new` differ from `old` (uint8, same length, a multiple of
    `elem_size`, both aligned to it); None if they are equal. Host memory is compared
    with numpy (several times faster than torch's CPU kernels for these steps), device
    memory with torch."""
    a, b = elements(new, elem_size), elements(old, elem_size)
    if a.device.type == "cpu":
        return _diff_host(a, b, elem_size)
    return _diff_device(a, b, elem_size)


def _diff_host(a: torch.Tensor, b: torch.Tensor, elem_size: int) -> Change | None:
    import numpy as np
    import torch

    mask = a.numpy() != b.numpy()
    where = np.flatnonzero(mask)
    changed = where.size
    if changed == 0:
        return None
    kind = cheapest(mask.size, changed, elem_size)
    if kind == "dense":
        return Change("dense", mask.size, changed)
    values = torch.from_numpy(a.numpy()[where]).view(torch.uint8)
    meta = np.packbits(mask, bitorder="little") if kind == "bitmap" else where.astype(np.int32).view(np.uint8)
    return Change(kind, mask.size, changed, torch.from_numpy(meta), values, where)


def _diff_device(a: torch.Tensor, b: torch.Tensor, elem_size: int) -> Change | None:
    """UNTESTED on a GPU here; the same steps run on CPU tensors in the tests."""
    import torch

    mask = a != b
    changed = int(torch.count_nonzero(mask))
    if changed == 0:
        return None
    kind = cheapest(mask.numel(), changed, elem_size)
    if kind == "dense":
        return Change("dense", mask.numel(), changed)
    where = mask.nonzero().view(-1)
    values = a[where].view(torch.uint8)
    meta = pack_bits(mask) if kind == "bitmap" else where.to(torch.int32).view(torch.uint8)
    return Change(kind, mask.numel(), changed, meta, values, where)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bytes, element i in bit i % 8 of byte i // 8; the last byte's
    unused bits are zero. Works in bytes throughout (no wider temporaries)."""
    import torch

    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    columns = padded.view(-1, 8)
    out = columns[:, 0].clone()
    for bit in range(1, 8):
        out |= columns[:, bit] << bit
    return out


def unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The bool mask of `count` elements that `pack_bits` packed into `bits`."""
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()


def popcount(bits: torch.Tensor) -> torch.Tensor:
    """Set bits in `bits` (uint8), as a 0-d int64 tensor on its device (no host sync)."""
    counts = [((bits >> i) & 1).sum() for i in range(8)]
    return sum(counts[1:], counts[0])
