"""A TrainerSource over a stream of (name, tensor) pairs, as RL frameworks hand them out.

verl (`engine.get_per_tensor_param()`), miles and slime (their HF weight iterators)
produce full HF tensors one after another, every trainer rank iterating the same
stream (the stream's own gathers are collectives). `IterableSource` turns such a
stream into the pull interface a Session uses: `gather(names)` takes tensors off
the stream until it holds every name asked for. Buckets follow the trainer's order,
which is the stream's order, so at most about one bucket is held at a time.

The names, shapes and dtypes must be known before `Session.connect`. Pass them as
`specs`, or call `discover(stream)` once: it runs the stream to the end, records
the specs and keeps the tensors on the host for that first update only (one copy
of the model in host memory, once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..core.source import TrainerSource
from ..core.types import ParamSpec, SenderGroup

if TYPE_CHECKING:
    import torch


def spec_of(name: str, tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


class IterableSource(TrainerSource):
    """Full HF tensors from a per-update stream of (name, tensor) pairs.

    Every rank of the trainer world gets every tensor from its stream, so the
    sender group is the whole world (as for FSDP2). `feed(stream)` before each
    `Session.update`, `drain()` after it: the rest of the stream (tensors no engine
    reads) is consumed, since the frameworks' streams are collectives.
    """

    name = "iterable"

    def __init__(self, specs: Sequence[ParamSpec] | None = None, *, process_group: Any = None) -> None:
        import torch.distributed as dist

        self._specs: list[ParamSpec] | None = list(specs) if specs is not None else None
        self._stream: Iterator[tuple[str, torch.Tensor]] | None = None
        self._held: dict[str, torch.Tensor] = {}
        if dist.is_available() and dist.is_initialized():
            ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
            rank = dist.get_rank()
        else:
            ranks, rank = (0,), 0
        self._group = SenderGroup(self.name, ranks, rank)

    @property
    def known(self) -> bool:
        """Whether the specs are known (given, or discovered from a first stream)."""
        return self._specs is not None

    def discover(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Run `stream` to its end: record the specs, keep the tensors (on the host) for
        the update that follows."""
        specs, held = [], {}
        for name, tensor in stream:
            if name in held:
                raise ValueError(f"the weight stream yields {name!r} twice")
            specs.append(spec_of(name, tensor))
            held[name] = tensor.detach().to("cpu", copy=True)
        self._specs, self._held, self._stream = specs, held, iter(())

    def feed(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The stream of this update (consumed by the gathers of `Session.update`)."""
        self._stream = iter(stream)

    def drain(self) -> None:
        """Consume what the update did not read, and drop what is held."""
        if self._stream is not None:
            for _ in self._stream:
                pass
        self._stream = None
        self._held = {}

    def sender_group(self) -> SenderGroup:
        return self._group

    def param_specs(self) -> list[ParamSpec]:
        if self._specs is None:
            raise RuntimeError("IterableSource: specs unknown; pass specs= or call discover(stream) first")
        return list(self._specs)

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        by_name = {s.name: s for s in self._specs or ()}
        out = {}
        for name in names:
            while name not in self._held:
                if self._stream is None:
                    raise RuntimeError("IterableSource: gather without a stream; call feed(stream) first")
                try:
                    got, tensor = next(self._stream)
                except StopIteration:
                    raise RuntimeError(f"the weight stream ended before HF tensor {name!r}") from None
                spec = by_name.get(got)
                if spec is not None and spec != spec_of(got, tensor):
                    raise RuntimeError(f"HF tensor {got!r} changed from {spec} to {spec_of(got, tensor)}")
                if spec is not None:
                    self._held[got] = tensor
            out[name] = self._held.pop(name)
        return out
