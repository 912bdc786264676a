"""Index-coded probing: where does each HF element land in an engine parameter?

One group at a time, vLLM's loader runs twice on float64 stand-ins of the
group's parameters: each input element holds its own code (its index among all
the group's input elements, plus one, plus a shift that differs between the two
runs) and the parameters start from a different fill each run. Reading both
results tells, per parameter element: untouched (both fills survive), a copy of
input element c (the codes differ by the shift), a constant the loader wrote
(equal in both runs, e.g. zeroed padding), or anything else (not a pure copy).
float64 holds every code exactly below 2**53.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.types import numel
from .model import RankModel

if TYPE_CHECKING:
    import torch

    from ...core.types import ParamSpec

_SHIFT = float(2**40)
_FILLS = (-0.5, -0.25)

UNTOUCHED, COPY, CONSTANT, OTHER = 0, 1, 2, 3


@dataclass
class ElementMap:
    """Per flat element of one parameter: its kind, the source code (input element index
    among the group's inputs, for COPY) and the value (for CONSTANT)."""

    kind: torch.Tensor  # int8
    source: torch.Tensor  # int64, -1 where not a copy
    value: torch.Tensor  # float64, the written constant where CONSTANT

    @property
    def pure(self) -> bool:
        return not bool((self.kind == OTHER).any())


def probe(model: RankModel, inputs: Sequence[ParamSpec], outputs: Sequence[str]) -> dict[str, ElementMap]:
    """The element map of each output parameter of one group."""
    import torch

    runs = []
    for fill, shift in zip(_FILLS, (0.0, _SHIFT)):
        data = {name: torch.full(tuple(model.params[name].shape), fill, dtype=torch.float64) for name in outputs}
        coded, start = [], 1
        for spec in inputs:
            n = numel(spec.shape)
            coded.append((spec.name, torch.arange(start, start + n, dtype=torch.float64).add_(shift).view(spec.shape)))
            start += n
        if start + _SHIFT >= 2**53:
            raise ValueError(f"group of {outputs[0]!r} has too many input elements to probe ({start})")
        with model.materialized(data):
            model.load(coded)
        runs.append({name: t.reshape(-1) for name, t in data.items()})
    return {name: _decode(runs[0][name], runs[1][name], total=start - 1) for name in outputs}


def _decode(a: torch.Tensor, b: torch.Tensor, total: int) -> ElementMap:
    import torch

    untouched = (a == _FILLS[0]) & (b == _FILLS[1])
    copy = ~untouched & (b - a == _SHIFT) & (a >= 1) & (a <= total) & (a == a.round())
    constant = ~untouched & ~copy & (a == b)
    kind = torch.full(a.shape, OTHER, dtype=torch.int8)
    kind[untouched], kind[copy], kind[constant] = UNTOUCHED, COPY, CONSTANT
    source = torch.where(copy, a - 1, torch.full_like(a, -1)).to(torch.int64)
    return ElementMap(kind, source, torch.where(constant, a, torch.zeros_like(a)))

