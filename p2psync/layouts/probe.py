"""Probing an engine's loader: which HF tensors feed which parameters, and what it writes.

Nothing here knows an engine: a loader is any callable that takes HF tensors and writes
into a module's parameters. `trace.trace_loader` finds, on meta, which HF tensors feed which
parameters; `connected_groups` turns that into the units produced together (q, k, v ->
qkv_proj). Two probes then run the real loader, one group at a time:

- `written_bytes` runs the real loader twice on random inputs, into parameter memory
  prefilled with 0x00 and with 0xFF bytes: where either run changed a byte the loader
  wrote it, and the first run holds the loader's bytes (the reference);
- `probe_elements` runs it twice on float64 stand-ins, each input element holding its own
  code (its index among the group's input elements, plus one, plus a shift that differs
  between the runs), the parameters starting from a different fill each run. Per
  parameter element: untouched (both fills survive), a copy of input element c (the
  codes differ by the shift), a constant the loader wrote (equal in both runs: zeroed
  padding), or anything else (not a copy). float64 holds every code exactly below 2**53.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..core.types import ParamSpec, numel
from .copymap import CONSTANT, COPY, OTHER, UNTOUCHED
from .rank_model import ParameterHolders

#: A loader: writes the given HF tensors into a module's parameters.
Loader = Callable[[Sequence[tuple[str, torch.Tensor]]], None]

_SHIFT = float(2**40)
_FILLS = (-0.5, -0.25)


def connected_groups(
    edges: Iterable[tuple[str, str]], inputs: Sequence[str], outputs: Sequence[str]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The connected components of `edges` (input, output), as (inputs, outputs): tensors
    that feed one parameter, and parameters fed by one tensor, are produced together.

    Each component lists its inputs in `inputs` order and its outputs in `outputs` order;
    components come in the order of their first output. Names in no edge are left out.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for source, target in edges:
        parent[find("in:" + source)] = find("out:" + target)
    members: dict[str, tuple[list[str], list[str]]] = {}
    for name in outputs:
        if "out:" + name in parent:
            members.setdefault(find("out:" + name), ([], []))[1].append(name)
    for name in inputs:
        if "in:" + name in parent and find("in:" + name) in members:
            members[find("in:" + name)][0].append(name)
    return [(tuple(ins), tuple(outs)) for ins, outs in members.values()]


def written_bytes(
    load: Loader, holders: ParameterHolders, views: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    inputs: Sequence[tuple[str, torch.Tensor]], nbytes: int, mutated: Collection[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's bytes for `inputs`, and which bytes it writes (a bool mask), over a buffer of
    `nbytes` that `views(buffer)` cuts into the parameters. Inputs named in `mutated` (the
    loader changes them in place) are given to each run as copies, so both runs see the same."""
    runs = [_loaded(load, holders, views, inputs, nbytes, mutated, pattern) for pattern in (0x00, 0xFF)]
    return runs[0], (runs[0] != 0x00) | (runs[1] != 0xFF)


def writes_like_loader(
    load: Loader, holders: ParameterHolders, views: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    inputs: Sequence[tuple[str, torch.Tensor]], nbytes: int, mutated: Collection[str],
    write: Callable[[torch.Tensor], None],
) -> bool:
    """Whether `write(buffer)` leaves a buffer of `nbytes` exactly as the loader leaves it for
    `inputs`, both over a buffer prefilled with 0x00 bytes and over one prefilled with 0xFF:
    then both write the same bytes (a byte only one of them wrote would have to equal both
    fills) with the same values. Two buffers at a time, no masks."""
    for pattern in (0x00, 0xFF):
        loaded = _loaded(load, holders, views, inputs, nbytes, mutated, pattern)
        written = torch.full((nbytes,), pattern, dtype=torch.uint8)
        write(written)
        if not torch.equal(loaded, written):
            return False
    return True


def _loaded(
    load: Loader, holders: ParameterHolders, views: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    inputs: Sequence[tuple[str, torch.Tensor]], nbytes: int, mutated: Collection[str], pattern: int,
) -> torch.Tensor:
    """A buffer of `nbytes` prefilled with `pattern` bytes after the loader wrote `inputs` into it."""
    out = torch.full((nbytes,), pattern, dtype=torch.uint8)
    with holders.backed(views(out)):
        load([(name, t.clone() if name in mutated else t) for name, t in inputs])
    return out


@dataclass
class ElementMap:
    """Per flat element of one parameter: its kind, the source code (input element index
    among the group's inputs, for COPY) and the value (for CONSTANT)."""

    kind: torch.Tensor  # int8
    source: torch.Tensor  # int64, -1 where not a copy
    value: torch.Tensor  # float64, the written constant where CONSTANT

    @property
    def pure(self) -> bool:
        """Every written element is a copy or a constant."""
        return not bool((self.kind == OTHER).any())


def probe_elements(
    load: Loader, holders: ParameterHolders, inputs: Sequence[ParamSpec], outputs: Sequence[str]
) -> dict[str, ElementMap]:
    """The element map of each output parameter of one group. Raises what the loader raises
    (a loader that refuses float64 inputs is not a plain copy)."""
    runs = []
    total = sum(numel(s.shape) for s in inputs)
    if total + _SHIFT >= 2**53:
        raise ValueError(f"group of {outputs[0]!r} has too many input elements to probe ({total})")
    for fill, shift in zip(_FILLS, (0.0, _SHIFT)):
        data = {name: torch.full(tuple(holders.params[name].shape), fill, dtype=torch.float64) for name in outputs}
        coded, start = [], 1
        for spec in inputs:
            n = numel(spec.shape)
            coded.append((spec.name, torch.arange(start, start + n, dtype=torch.float64).add_(shift).view(spec.shape)))
            start += n
        with holders.backed(data):
            load(coded)
        runs.append({name: t.reshape(-1) for name, t in data.items()})
    return {name: _decode(runs[0][name], runs[1][name], total) for name in outputs}


def _decode(a: torch.Tensor, b: torch.Tensor, total: int) -> ElementMap:
    untouched = (a == _FILLS[0]) & (b == _FILLS[1])
    copy = ~untouched & (b - a == _SHIFT) & (a >= 1) & (a <= total) & (a == a.round())
    constant = ~untouched & ~copy & (a == b)
    kind = torch.full(a.shape, OTHER, dtype=torch.int8)
    kind[untouched], kind[copy], kind[constant] = UNTOUCHED, COPY, CONSTANT
    source = torch.where(copy, a - 1, torch.full_like(a, -1)).to(torch.int64)
    return ElementMap(kind, source, torch.where(constant, a, torch.zeros_like(a)))
