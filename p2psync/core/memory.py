"""Raw addresses back to tensor views, for transports that cannot write to a bare address.

A `WriteBatch` names memory by address. Process writes (`process_vm_writev`) take
addresses as they are; device copies and two-sided receives need tensors. An
`AddressMap` turns an address range back into uint8 views of the registered
tensors' storages, and refuses any byte outside them, so that a wrong address
never becomes a write into unrelated memory. The torch.distributed transport
uses it too.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The one device all `tensors` live on (a transport serves one kind of memory per rank)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors to expose must all live on one device, got {sorted(map(str, devices)) or 'none'}")
    return devices.pop()


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `tensor`."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


@dataclass(frozen=True)
class _Region:
    """Mapped bytes [start, end) whose address `a` is `flat[a - base]`."""

    start: int
    end: int
    flat: torch.Tensor
    base: int

    def same_storage(self, other: _Region) -> bool:
        return self.base == other.base and self.flat.data_ptr() == other.flat.data_ptr()


class AddressMap:
    """Tensors by address; ranges come back as views of their storages.

    Each entry is a tensor and the address its bytes have for the peer that names
    them (its own `data_ptr()` unless given: memory opened through CUDA IPC has
    another address in the exporting process). Touching entries of one storage
    merge, so a range that runs over several back-to-back parameters is one view.
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._entries: list[tuple[torch.Tensor, int]] = [(t, t.data_ptr()) for t in tensors]
        self._rebuild()

    def add(self, tensor: torch.Tensor, addr: int | None = None) -> None:
        self._entries.append((tensor, tensor.data_ptr() if addr is None else addr))
        self._rebuild()

    def remove(self, tensor: torch.Tensor) -> None:
        self._entries = [(t, a) for t, a in self._entries if t is not tensor]
        self._rebuild()

    def _rebuild(self) -> None:
        regions: list[_Region] = []
        for tensor, addr in sorted(self._entries, key=lambda e: e[1]):
            flat = storage_bytes(tensor)
            region = _Region(
                addr, addr + tensor.numel() * tensor.element_size(), flat, addr - (tensor.data_ptr() - flat.data_ptr())
            )
            if regions and regions[-1].same_storage(region) and region.start <= regions[-1].end:
                last = regions.pop()
                region = _Region(last.start, max(last.end, region.end), last.flat, last.base)
            regions.append(region)
        self._regions = regions
        self._starts = [r.start for r in regions]

    def pieces(self, addr: int, nbytes: int) -> list[torch.Tensor]:
        """Views covering [addr, addr + nbytes) in order: one per storage it crosses."""
        out = []
        end = addr + nbytes
        i = bisect.bisect_right(self._starts, addr) - 1
        while addr < end:
            if i < 0 or i >= len(self._regions) or not self._regions[i].start <= addr < self._regions[i].end:
                raise ValueError(
                    f"bytes [{addr:#x}, {end:#x}) are not all in registered memory (first gap at {addr:#x})"
                )
            region = self._regions[i]
            stop = min(end, region.end)
            out.append(region.flat[addr - region.base : stop - region.base])
            addr, i = stop, i + 1
        return out

    def view(self, addr: int, nbytes: int) -> torch.Tensor:
        """The one view of [addr, addr + nbytes); the range must lie in one storage."""
        pieces = self.pieces(addr, nbytes)
        if len(pieces) != 1:
            raise ValueError(f"bytes [{addr:#x}, +{nbytes}) span {len(pieces)} allocations")
        return pieces[0]


def scatter(source: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """Copy consecutive bytes of `source` into `pieces`, in order."""
    offset = 0
    for piece in pieces:
        piece.copy_(source[offset : offset + piece.numel()], non_blocking=True)
        offset += piece.numel()
