"""Probing an engine's loader: which HF tensors feed which parameters, and what it writes.

Nothing here knows an engine: a loader is any callable that takes HF tensors and writes
into a module's parameters. Three probes, each on one group at a time:

- `trace_feeds` runs the loader once on the meta device under a dispatch mode that
  follows data from each HF tensor to the parameters it is copied into; its
  `connected_groups` are the units produced together (q, k, v -> qkv_proj);
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

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.types import ParamSpec, numel
from .copymap import CONSTANT, COPY, OTHER, UNTOUCHED
from .rank_model import ParameterHolders

#: A loader: writes the given HF tensors into a module's parameters.
Loader = Callable[[Sequence[tuple[str, torch.Tensor]]], None]

_SHIFT = float(2**40)
_FILLS = (-0.5, -0.25)


def trace_feeds(load: Loader, params: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec]) -> dict[str, set[str]]:
    """For each parameter (on meta), the HF tensors whose data the loader copies into it."""
    inputs = {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in specs}
    flow = _Flow(inputs, params)
    with flow:
        load(list(inputs.items()))
    return dict(flow.writes)


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
    inputs: Sequence[tuple[str, torch.Tensor]], nbytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's bytes for `inputs`, and which bytes it writes (a bool mask), over a buffer of
    `nbytes` that `views(buffer)` cuts into the parameters."""
    runs = []
    for pattern in (0x00, 0xFF):
        out = torch.full((nbytes,), pattern, dtype=torch.uint8)
        with holders.backed(views(out)):
            load([(name, t.clone()) for name, t in inputs])  # both runs see the same inputs
        runs.append(out)
    return runs[0], (runs[0] != 0x00) | (runs[1] != 0xFF)


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


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Flow(TorchDispatchMode):
    """Follows which HF tensors each tensor was computed from, down to parameter writes."""

    def __init__(self, inputs: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.sources: dict[int, set[str]] = {_key(t): {name} for name, t in inputs.items()}
        self.params = {_key(t): name for name, t in params.items()}
        self.writes: dict[str, set[str]] = defaultdict(set)
        self._alive: list[Any] = []  # storages stay alive so that their ids are never reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        came_from = set().union(*(self.sources.get(_key(t), ()) for t in flat_in))
        if not came_from:
            return out
        written = _mutated(func, args, kwargs) + [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in written:
            key = _key(t)
            if key in self.params:
                self.writes[self.params[key]] |= came_from
            else:
                self.sources.setdefault(key, set()).update(came_from)
                self._alive.append(t.untyped_storage())
        return out


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an aten op writes into."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out
