"""What an engine adapter supplies for one engine rank: its model, built without storage,
and its own loader. Layouts are made from this alone (see `layout.EngineLayout`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RankModel(ABC):
    """One engine rank's model as the engine builds it for that rank (on the meta device: no
    storage), and the engine's own `load_weights` run as that rank.

    Layouts give parameters storage only while a group loads (`ParameterHolders.backed`),
    so a layout of a huge model costs about one group's memory.
    """

    #: The rank's model; its `named_parameters()` are exactly what the rank publishes.
    model: torch.nn.Module

    @abstractmethod
    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The engine's own loader for these HF tensors, writing into `model`'s parameters
        (those on meta take shape-only no-op writes)."""

    def unloaded_params(self) -> frozenset[str]:
        """Parameters the engine's loader leaves as the engine set them, since no HF tensor of a
        trainer is ever loaded into them (an fp8 engine's kv-cache scales, 1.0 where the checkpoint
        has none): layouts write nothing there. None by default: every parameter must be fed."""
        return frozenset()

    def produced_together(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """Pairs of these HF tensors the engine's loader needs in one call although neither feeds
        the other's parameters (a LoRA loader that reads A and B of a module together). None by
        default."""
        return []

    def post_load(self) -> None:
        """The engine's step after loading (derived tensors such as DeepSeek MLA's `w_kc`),
        which an engine runs after each update once the new bytes are in place. None by default."""


class ParameterHolders:
    """Every (module, attribute) that holds each parameter of a model: tied weights have several.
    Found once, so that giving parameters storage for a load costs no walk of the model."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        name_of = {id(p): name for name, p in self.params.items()}
        self._holders: dict[str, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is not None and id(p) in name_of:
                    self._holders[name_of[id(p)]].append((sub, attr))

    @contextmanager
    def backed(self, data: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Inside the block, each parameter named in `data` is a stand-in of its own class and
        attributes (the engine's `weight_loader` and friends) over that tensor, in every module
        holding it, so the engine's loader writes into `data`; the originals return after."""
        import torch

        swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        try:
            for name, tensor in data.items():
                original = self.params[name]
                stand_in = torch.Tensor._make_subclass(type(original), tensor, False)
                stand_in.__dict__.update(original.__dict__)
                for holder, attr in self._holders[name]:
                    holder._parameters[attr] = stand_in
                    swapped.append((holder, attr, original))
            yield
        finally:
            for holder, attr, original in reversed(swapped):
                holder._parameters[attr] = original


def parameter_tree(params: Sequence[tuple[str, tuple[int, ...], str]]) -> torch.nn.Module:
    """A module whose `named_parameters()` are exactly `params` ((dotted name, shape, dtype)), on
    meta: the rank model of an engine whose tensors are no torch module's (adapter copies)."""
    import torch

    root = torch.nn.Module()
    for name, shape, dtype in params:
        *path, leaf = name.split(".")
        owner: torch.nn.Module = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(
            leaf, torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype), device="meta"), requires_grad=False)
        )
    return root

