"""Layouts: how the HF tensors become the exact bytes of one target's parameters."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .types import Region

if TYPE_CHECKING:
    import torch

#: Byte alignment of parameters inside a group's bytes and of groups inside a transfer
#: buffer, so that every dtype view starts aligned.
ALIGN = 64


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ParamGroup:
    """Target parameters that are produced together from a set of HF tensors.

    A fused engine parameter (`qkv_proj`) needs several HF tensors; every input of
    a group must arrive in the same bucket, and every target parameter belongs to
    exactly one group.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class CopyRun:
    """`numel` elements of HF tensor `source`, from its flat element `source_offset`, copied
    (cast to the parameter's dtype) to flat element `param_offset` of parameter `param`."""

    param: str
    param_offset: int
    source: str
    source_offset: int
    numel: int


class Layout(ABC):
    """Turns HF tensors into the bytes of one target (one layout key and rank)."""

    @abstractmethod
    def groups(self) -> Sequence[ParamGroup]:
        """Every group of this target, each target parameter in exactly one."""

    @abstractmethod
    def fill(self, group: ParamGroup, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> list[Region]:
        """Write the bytes of `group` into `out` (uint8, at least `group.nbytes` long).

        Returns the regions written, with `buffer_offset` relative to `out`. Only
        what the engine's own loader would write is produced: padding it leaves
        alone is not part of any region.
        """

    def left_alone(self) -> Sequence[str]:
        """Target parameters in no group: the engine keeps what it set there, as its own loader
        does (an fp8 engine's kv-cache scales, which the checkpoint does not carry). None by default."""
        return ()

    def copy_dtype(self, group: ParamGroup) -> str | None:
        """The dtype of all of `group`'s outputs when `fill` only copies input elements into
        them (casting to it, plus constants): then inputs cast to that dtype before the
        trainer gathers them give the same bytes, and the gather moves fewer. None (the
        default) where the bytes are computed from the inputs in their own dtype."""
        return None

    def copy_runs(self, group: ParamGroup, held: Mapping[str, Sequence[tuple[int, int]]]) -> list[CopyRun] | None:
        """The copies of `group` whose source elements this trainer rank holds: `held` gives,
        per HF tensor, the flat element ranges [start, end) it holds. With them, every rank
        writes its own part of a target without gathering. None (the default) where the
        group's bytes are not only copies and constants: its inputs must be gathered."""
        return None

    def fill_constants(self, group: ParamGroup, out: torch.Tensor) -> list[Region]:
        """Write the constants `fill` writes for `group` (e.g. zeroed padding), and nothing
        else, into `out`; the regions written. Needed with `copy_runs` only."""
        return []

    def has_constants(self, group: ParamGroup) -> bool:
        """Whether `fill_constants` writes anything for `group`. A layout that knows says so:
        the trainer then makes no buffer of the group's size at connect to learn there are
        none (most groups of a model have none). True, to be safe, by default."""
        return True
