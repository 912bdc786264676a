"""vLLM's model of one TP rank, built without storage, and the groups its loader forms.

Parameters stay on the meta device; a parameter gets storage (a view into the
caller's buffer) only while its group is loaded, so a layout of a huge model
costs about one group's memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ...core.relation import connected_groups
from . import shim

if TYPE_CHECKING:
    import torch

    from ...core.types import ParamSpec


class RankModel:
    """The rank model of `vllm_config` for TP rank `rank`, on meta."""

    def __init__(self, vllm_config: Any, rank: int) -> None:
        self.config = vllm_config
        self.rank = rank
        self.model = shim.build_model(vllm_config, rank, "meta")
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        # Every (module, attribute) holding each parameter: tied weights have several.
        name_of = {id(p): name for name, p in self.params.items()}
        self._holders: dict[str, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
        for module in self.model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in name_of:
                    self._holders[name_of[id(p)]].append((module, attr))

    @contextmanager
    def materialized(self, data: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Inside the block, the parameters named in `data` hold those tensors; the rest stay on meta
        (loads into them are shape-only no-ops)."""
        originals = {name: self.params[name] for name in data}
        try:
            for name, tensor in data.items():
                live = shim.like(originals[name], tensor)
                for module, attr in self._holders[name]:
                    module._parameters[attr] = live
            yield
        finally:
            for name, param in originals.items():
                for module, attr in self._holders[name]:
                    module._parameters[attr] = param

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own `load_weights` of this rank."""
        shim.load_weights(self.model, self.config, self.rank, weights)

    def feeds(self, specs: Sequence[ParamSpec]) -> dict[str, set[str]]:
        """Which engine parameters each HF tensor feeds, found by running the loader on meta
        tensors with every parameter's loader wrapped to record the parameter it writes."""
        import torch

        feeds: dict[str, set[str]] = defaultdict(set)
        current = [""]

        def recording(name: str, loader: Any) -> Any:
            def record(param: Any, *args: Any, **kwargs: Any) -> Any:
                result = loader(param, *args, **kwargs)
                if result is not False:  # FusedMoE answers False for experts this rank does not hold
                    feeds[current[0]].add(name)
                return result

            return record

        saved = {name: dict(p.__dict__) for name, p in self.params.items()}
        try:
            for name, p in self.params.items():
                p.weight_loader = recording(name, shim.weight_loader(p))

            def meta_inputs() -> Iterator[tuple[str, torch.Tensor]]:
                for spec in specs:
                    current[0] = spec.name
                    yield spec.name, torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device="meta")

            self.load(meta_inputs())
        except Exception as exc:  # vLLM's loaders assert shapes: say which HF tensor they refused
            shape = next((list(s.shape) for s in specs if s.name == current[0]), None)
            raise LoaderRefused(f"vLLM's loader refuses HF tensor {current[0]!r} of shape {shape}: {exc}") from exc
        finally:
            for name, p in self.params.items():
                p.__dict__ = saved[name]
        return dict(feeds)


class LoaderRefused(ValueError):
    """vLLM's own loader would not take the trainer's HF tensors (a shape or name it does not expect)."""


def groups_of(
    feeds: Mapping[str, set[str]], inputs: Sequence[str], params: Sequence[str]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Groups of HF tensors and the parameters they feed, in the trainer's and the engine's order."""
    return connected_groups(((hf, out) for hf, outs in feeds.items() for out in outs), inputs, params)
