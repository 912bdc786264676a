"""A TrainerSource over a stream of (name, tensor) pairs, as RL frameworks hand them out.

verl (`engine.get_per_tensor_param()`), miles and slime (their HF weight iterators)
produce full HF tensors one after another, every trainer rank iterating the same
stream (the stream's own gathers are collectives). `IterableSource.take(stream)` runs
the stream to its end before the update and keeps only this rank's rows of each tensor
(`torch.chunk`'s split of dim 0 over the trainer world, as FSDP2 shards): on W ranks,
1/W of the model in host memory per rank, never a full copy. Those rows are the rank's
local shards, so the default session writes each rank's rows straight to the engine
ranks that hold them, with no gather; `gather` (for `gather="always"`) all-gathers them.

Running the whole stream first keeps its collectives in the same order on every rank
(the session's own collectives come after it), and the engines keep serving while it
runs: the update that follows only writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.rows import all_gather_rows, row_chunk
from ..core.source import LocalShard, TrainerSource
from ..core.types import ParamSpec, SenderGroup

if TYPE_CHECKING:
    import torch


def spec_of(name: str, tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as rows: a scalar is one row of one element."""
    return shape or (1,)


class IterableSource(TrainerSource):
    """Full HF tensors from a per-update stream of (name, tensor) pairs, kept as this rank's rows.

    Every rank of the trainer world gets every tensor from its stream, so the sender group
    is the whole world. `take(stream)` before each `Session.update` (the first one learns
    the names, shapes and dtypes unless `specs` gave them), `release()` after it.
    """

    name = "iterable"

    def __init__(self, specs: Sequence[ParamSpec] | None = None, *, process_group: Any = None) -> None:
        import torch.distributed as dist

        self._specs: list[ParamSpec] | None = list(specs) if specs is not None else None
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}  # HF name -> (first row, this rank's rows)
        self._process_group = process_group
        if dist.is_available() and dist.is_initialized():
            ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
            rank = dist.get_rank()
        else:
            ranks, rank = (0,), 0
        self._group = SenderGroup(self.name, ranks, rank)
        self._index, self._world = ranks.index(rank), len(ranks)

    @property
    def held_bytes(self) -> int:
        """Host bytes this rank holds of the stream it took: its rows of every tensor."""
        return sum(rows.nbytes for _, rows in self._rows.values())

    def take(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Run this update's `stream` to its end, keeping this rank's rows of each tensor on
        the host. Every rank runs it whole (its gathers are collectives). Raises, before
        anything is written, where the stream differs from the first one (or from `specs`)."""
        expected = {s.name: s for s in self._specs} if self._specs is not None else None
        specs: list[ParamSpec] = []
        self._rows = rows = {}
        for name, tensor in stream:
            spec = spec_of(name, tensor)
            if name in rows:
                raise ValueError(f"the weight stream yields HF tensor {name!r} twice")
            if expected is not None and expected.get(name) != spec:
                was = f"was {expected[name]}" if name in expected else "not in its first update"
                raise ValueError(f"the weight stream's HF tensor {name!r} is {spec} ({was})")
            shape = _row_shape(spec.shape)
            first, end = row_chunk(shape[0], self._index, self._world)
            rows[name] = first, tensor.detach().reshape(shape)[first:end].to("cpu", copy=True)
            specs.append(spec)
        if expected is not None and len(rows) != len(expected):
            missing = [n for n in expected if n not in rows]
            raise ValueError(f"the weight stream ended without {len(missing)} HF tensor(s): {', '.join(missing[:5])}")
        if self._specs is None:
            self._specs = specs

    def release(self) -> None:
        """Drop the rows taken (after the update)."""
        self._rows = {}

    def sender_group(self) -> SenderGroup:
        return self._group

    def param_specs(self) -> list[ParamSpec]:
        if self._specs is None:
            raise RuntimeError("IterableSource: specs unknown; pass specs= or take(stream) first")
        return list(self._specs)

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """This rank's rows of every tensor taken: flat elements [first * row, end * row)."""
        out = {}
        for name in names:
            first, rows = self._taken(name)
            end = first + rows.shape[0]
            per_row = rows[0].numel() if rows.shape[0] else 0
            ranges = ((first * per_row, end * per_row),) if end > first else ()
            out[name] = LocalShard(ranges, rows.reshape(-1))
        return out

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The full tensors, all-gathered from every rank's rows (collective; one all-gather per dtype)."""
        shapes = {s.name: s.shape for s in self.param_specs()}
        by_dtype: dict[torch.dtype, list[tuple[str, Any, torch.Tensor]]] = {}
        for name in names:
            rows = self._taken(name)[1]
            by_dtype.setdefault(rows.dtype, []).append((name, _row_shape(shapes[name]), rows))
        full: dict[str, torch.Tensor] = {}
        for shards in by_dtype.values():
            full.update(all_gather_rows(self._process_group, shards) if self._world > 1 else
                        {name: rows for name, _, rows in shards})
        return {name: full[name].reshape(shapes[name]) for name in names}

    def _taken(self, name: str) -> tuple[int, torch.Tensor]:
        if name not in self._rows:
            raise RuntimeError(f"IterableSource: HF tensor {name!r} was not taken; call take(stream) before the update")
        return self._rows[name]
