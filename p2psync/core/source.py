"""The TrainerSource protocol: a trainer's weights as full HF tensors, gathered on demand."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .types import ParamSpec, SenderGroup, TargetTable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LocalShard:
    """The part of one HF tensor this rank holds without a gather: flat elements `ranges`
    ([start, end), ascending) of the full tensor, whose values `data` (flat, contiguous)
    holds back to back."""

    ranges: tuple[tuple[int, int], ...]
    data: torch.Tensor


class TrainerSource(ABC):
    """One trainer rank's view of the model it trains.

    Subclasses wrap a framework's model (FSDP2, Megatron, ...). `gather` is a
    collective: every rank of the sender group calls it with the same names in the
    same order, and every rank gets the full tensors back.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def sender_group(self) -> SenderGroup:
        """The ranks that hold the same HF tensors as this one after gathering."""

    @abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """Every HF tensor this rank's group can produce, in the trainer's order."""

    @abstractmethod
    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors for `names` (collective over the sender group)."""

    def gather_cast(self, names: Sequence[str], dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """`gather`, with the tensors named in `dtypes` cast to those dtypes. Sources that
        can cast their shards before gathering override this to gather fewer bytes."""
        import torch

        tensors = self.gather(names)
        return {n: t.to(getattr(torch, dtypes[n])) if n in dtypes else t for n, t in tensors.items()}

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """The parts of HF tensors `names` this rank holds as they are, for gather-free sends:
        every element of a tensor must be held by exactly one rank of the sender group, so
        that each rank writes its own part. Tensors left out are gathered. Not a collective;
        called at connect (the ranges) and at every update (the data). None by default."""
        return {}

    def check_table(self, table: TargetTable) -> None:
        """Raise ConnectError, naming the engine rank and why, where this source cannot update
        what `table` publishes beyond its parameters' names, shapes and dtypes (which connect
        checks itself): a LoRA adapter of another rank or alpha, say. At connect, on every
        rank alike, before anything is written. Every table passes by default."""

    def bucket_kind(self, name: str) -> str:
        """Tensors of different kinds never share a bucket (Megatron gathers experts over
        another group than the rest). One kind by default."""
        return ""
