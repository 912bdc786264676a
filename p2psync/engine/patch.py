"""The engine side of delta updates: a registered patch area and the apply that scatters
its patches into the live parameters.

Trainers write a patch's pieces (see `delta`) into the area like any other bytes,
then ask the endpoint to apply the records that describe them. The apply is the
same for every engine: torch ops on the parameters' device. On a GPU the area lives
in device memory and every step runs as device kernels (bit unpacking,
`masked_scatter_`, `index_copy_`) with one synchronization at the end, before the
trainer may overwrite the area; that path is UNTESTED here (no GPU on this
project's machines). Every record is checked before any parameter byte changes:
its bounds on the host, and on the device its bitmap's set bits and its indices'
range, read back with a single synchronization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..core.delta import PatchRecord, elements, meta_bytes, popcount, unpack_bits

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Default patch area: an eighth of the rank's parameter bytes, within these bounds.
MIN_AREA_BYTES = 1 << 20
MAX_AREA_BYTES = 64 << 20


def default_area_bytes(param_bytes: int) -> int:
    """A patch area big enough for a step's patch of most parameters at once, small
    beside the weights (a patch larger than the area is sent in several parts)."""
    return min(MAX_AREA_BYTES, max(MIN_AREA_BYTES, param_bytes // 8))


class PatchArea:
    """`nbytes` of registered memory on the parameters' device that patches land in."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        import torch

        if nbytes <= 0:
            raise ValueError(f"a patch area needs a positive size, got {nbytes}")
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def apply(self, params: Mapping[str, torch.Tensor], rows: Sequence[object]) -> int:
        """Scatter the patch records `rows` (as `PatchRecord.to_wire` sent them) into
        `params`; return how many elements changed. Raises ValueError, naming the
        parameter, before any byte changes if a record does not fit its parameter or
        the area, or disagrees with its own bitmap or indices."""
        records = [PatchRecord.from_wire(row) for row in rows]
        for record in records:
            self._check_bounds(params, record)
        self._check_contents(records)
        for record in records:
            self._scatter(params[record.param], record)
        if self.tensor.device.type == "cuda":
            import torch

            # The trainer may overwrite the area as soon as this call returns.
            torch.cuda.synchronize(self.tensor.device)
        return sum(r.changed for r in records)

    def _check_bounds(self, params: Mapping[str, torch.Tensor], record: PatchRecord) -> None:
        param = params.get(record.param)
        if param is None:
            raise ValueError(f"patch for parameter {record.param!r}, which this rank does not hold")
        held = param.numel() * param.element_size()
        problems = []
        if record.elem_size not in (1, 2, 4, 8):
            problems.append(f"element size {record.elem_size}")
        elif (param.data_ptr() + record.param_offset) % record.elem_size or (
            self.tensor.data_ptr() + record.values_offset
        ) % record.elem_size:
            problems.append(f"offsets not aligned to its {record.elem_size}-byte elements")
        if record.param_offset + record.nbytes > held:
            problems.append(f"bytes [{record.param_offset}, +{record.nbytes}) beyond its {held}")
        if record.end > self.nbytes:
            problems.append(f"patch-area bytes up to {record.end} beyond the area's {self.nbytes}")
        if record.kind == "index" and record.meta_offset % 4:
            problems.append("indices not 4-byte aligned")
        if not 0 < record.changed <= record.count:
            problems.append(f"{record.changed} changed of {record.count} elements")
        if problems:
            raise ValueError(f"patch record for parameter {record.param!r}: {'; '.join(problems)}")

    def _meta(self, record: PatchRecord) -> torch.Tensor:
        start = record.meta_offset
        return self.tensor[start : start + meta_bytes(record.kind, record.count, record.changed)]

    def _check_contents(self, records: Sequence[PatchRecord]) -> None:
        """A bitmap must have exactly `changed` bits set (none past `count`), indices must
        lie in [0, count): checked on the area's device, read back once."""
        import torch

        found = []
        for record in records:
            meta = self._meta(record)
            if record.kind == "bitmap":
                found.append(popcount(meta) == record.changed)
            else:
                indices = meta.view(torch.int32)
                found.append((indices.min() >= 0) & (indices.max() < record.count))
        if not found:
            return
        ok = torch.stack(found).cpu().tolist()
        bad = [r.param for r, good in zip(records, ok) if not good]
        if bad:
            raise ValueError(f"patch records whose bitmap or indices disagree with their counts: parameters {bad[:5]}")

    def _scatter(self, param: torch.Tensor, record: PatchRecord) -> None:
        """Host memory scatters with numpy (unpacking bits and placing values is several
        times faster there than torch's CPU kernels); device memory with torch."""
        import torch

        flat = param.detach().reshape(-1).view(torch.uint8)
        target = elements(flat[record.param_offset : record.param_offset + record.nbytes], record.elem_size)
        start = record.values_offset
        values = elements(self.tensor[start : start + record.changed * record.elem_size], record.elem_size)
        meta = self._meta(record)
        if target.device.type == "cpu":
            _scatter_host(target.numpy(), record, meta.numpy(), values.numpy())
        else:
            _scatter_device(target, record, meta, values)


def _scatter_device(target: torch.Tensor, record: PatchRecord, meta: torch.Tensor, values: torch.Tensor) -> None:
    """Kernels on the parameters' device, no host synchronization. UNTESTED on a GPU here;
    the tests run it on CPU tensors against the host path."""
    import torch

    if record.kind == "bitmap":
        target.masked_scatter_(unpack_bits(meta, record.count), values)
    else:
        target.index_copy_(0, meta.view(torch.int32).long(), values)


def _scatter_host(target: np.ndarray, record: PatchRecord, meta: np.ndarray, values: np.ndarray) -> None:
    import numpy as np

    if record.kind == "bitmap":
        np.place(target, np.unpackbits(meta, count=record.count, bitorder="little").view(bool), values)
    else:
        target[meta.view(np.int32)] = values
