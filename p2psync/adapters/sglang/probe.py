"""Probing sglang's loaders: which HF tensors feed which parameters, and what they write.

Nothing here is sglang-specific: a loader is any callable that takes HF tensors
and writes into a module's parameters. Parameter groups come from running the
loader once on the meta device under a dispatch mode that follows data from each
HF tensor to the parameters it is copied into, so no model is hard-coded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from ...core.types import ParamSpec

#: A loader: writes the given HF tensors into the module's parameters.
Loader = Callable[[Sequence[tuple[str, torch.Tensor]]], None]


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
        written = _mutated(func, args, kwargs) + [
            t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
        ]
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


def trace_writes(load: Loader, params: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec]) -> dict[str, set[str]]:
    """For each parameter (on meta), the HF tensors whose data the loader copies into it."""
    inputs = {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in specs}
    flow = _Flow(inputs, params)
    with flow:
        load(list(inputs.items()))
    return dict(flow.writes)




@contextmanager
def backed(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Let the named parameters of a meta module use `tensors` as storage, then put the originals back.

    Each parameter is replaced, in every module that holds it, by a stand-in of the
    same class and attributes (sglang's `weight_loader` and friends) over the given
    tensor, so the module's own loader writes into `tensors`.
    """
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                holders[id(param)].append((module, leaf))
    params = dict(model.named_parameters())
    replaced = []
    try:
        for name, tensor in tensors.items():
            param = params[name]
            stand_in = torch.Tensor._make_subclass(type(param), tensor, False)
            stand_in.__dict__.update(param.__dict__)
            for module, leaf in holders[id(param)]:
                module._parameters[leaf] = stand_in
                replaced.append((module, leaf, param))
        yield
    finally:
        for module, leaf, param in reversed(replaced):
            module._parameters[leaf] = param
