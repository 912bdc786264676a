"""Compile once per structure: groups that differ only in their layer or expert numbers share
one compiled map, renamed.

A model's decoder layers are loaded the same way layer after layer, so probing every one
of them costs layers x elements for nothing. Groups whose input and output names are equal
once every number in them is masked, with equal shapes and dtypes position by position, are
one structure. Its first, second and last instances are compiled in full; if the second and
the last equal the first renamed (names mapped position by position), every other instance
is the first renamed, without running the loader. Otherwise every instance is compiled on
its own, as without sharing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..core.types import ParamSpec

#: A group as `connected_groups` gives it: its inputs and its outputs.
Instance = tuple[tuple[str, ...], tuple[str, ...]]
G = TypeVar("G")
T = TypeVar("T")

_NUMBER = re.compile(r"\d+")


def structure_key(
    instance: Instance, sources: Mapping[str, ParamSpec], params: Mapping[str, Any]
) -> tuple[Any, ...]:
    """What two groups must share to be one structure: masked names, shapes and dtypes."""
    inputs, outputs = instance
    return (
        tuple((_NUMBER.sub("#", n), tuple(sources[n].shape), sources[n].dtype) for n in inputs),
        tuple((_NUMBER.sub("#", n), tuple(params[n].shape), str(params[n].dtype)) for n in outputs),
    )


def compile_shared(
    instances: Sequence[Instance],
    key: Callable[[Instance], tuple[Any, ...]],
    compile_one: Callable[[Instance], G],
    rename: Callable[[G, Mapping[str, str]], G],
) -> tuple[list[G], int]:
    """Every instance compiled, in order, and how many were compiled by renaming another."""
    out: dict[int, G] = {}
    shared = 0
    for members in by_structure(instances, key):
        checked = sampled_instances(members)
        for i in checked:
            out[i] = compile_one(instances[i])
        first = members[0]
        if len(members) > len(checked) and all(
            out[i] == rename(out[first], names_between(instances[first], instances[i])) for i in checked[1:]
        ):
            for i in members:
                if i not in out:
                    out[i] = rename(out[first], names_between(instances[first], instances[i]))
                    shared += 1
        else:
            for i in members:
                if i not in out:
                    out[i] = compile_one(instances[i])
    return [out[i] for i in range(len(instances))], shared


def by_structure(instances: Sequence[Instance], key: Callable[[Instance], tuple[Any, ...]]) -> list[list[int]]:
    """The indices of `instances`, one list per structure (equal `key`), each in order."""
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for i, instance in enumerate(instances):
        by_key.setdefault(key(instance), []).append(i)
    return list(by_key.values())


def sampled_instances(members: Sequence[int]) -> list[int]:
    """Of one structure's instances, those checked against the loader: first, second and last."""
    return sorted({members[0], members[1 % len(members)], members[-1]})


def names_between(a: Instance, b: Instance) -> dict[str, str]:
    """Position by position, the name in `b` of each name in `a` (inputs and outputs)."""
    return dict(zip(a[0] + a[1], b[0] + b[1]))


def renamed(item: Any, names: Mapping[str, str], fields: Sequence[str]) -> Any:
    """A frozen dataclass `item` with its name `fields` mapped through `names`."""
    changes = {f: names.get(getattr(item, f), getattr(item, f)) for f in fields if getattr(item, f) is not None}
    return dataclasses.replace(item, **changes)


def sampled(names: Sequence[str]) -> set[str]:
    """Of one group's inputs, those of its first, second and last instance where the group
    repeats one structure (a fused parameter of many experts: `experts.#.gate_proj.weight`
    for every expert); every input where nothing repeats more than three times. Instances
    are the tuples of numbers in the names, in numeric order."""
    families: dict[str, int] = {}
    for name in names:
        masked = _NUMBER.sub("#", name)
        families[masked] = families.get(masked, 0) + 1
    if all(count <= 3 for count in families.values()):
        return set(names)
    numbers = {name: tuple(int(n) for n in _NUMBER.findall(name)) for name in names}
    instances = sorted(set(numbers.values()))
    keep = {instances[0], instances[1], instances[-1]}
    return {name for name in names if numbers[name] in keep}


#: A name's layer: its first number between dots (`model.layers.7.mlp...` is layer 7).
_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return None if match is None else int(match.group())


def in_layer(name: str, layer: int) -> str:
    """`name` with its layer number replaced by `layer`."""
    return _LAYER.sub(str(layer), name, count=1)


def traced_once_per_layer(
    trace: Callable[[Sequence[ParamSpec]], T], specs: Sequence[ParamSpec],
    rename: Callable[[T, int, int], T | None], merge: Callable[[Sequence[T]], T],
) -> T:
    """`trace(specs)`, running the loader only on the first, second and last layer of each layer
    structure (layers whose HF tensors are equal once their layer number is masked) and the
    tensors of no layer: every other layer's trace is its structure's first layer's, renamed.
    `rename(trace, a, b)`: the part of `trace` of layer a, its names moved to layer b (None
    where a moved name does not exist or the trace crosses layers). The second and last
    layers must equal the first renamed, or every layer is traced. Loading a 48-layer model's experts on meta costs
    seconds per layer in an engine's Python loader; this pays for three."""
    layers: dict[int, list[ParamSpec]] = {}
    rest: list[ParamSpec] = []
    for spec in specs:
        layer = layer_of(spec.name)
        (rest if layer is None else layers.setdefault(layer, [])).append(spec)
    structures: dict[tuple[Any, ...], list[int]] = {}
    for layer in sorted(layers):
        key = tuple(sorted((_LAYER.sub("#", s.name, count=1), tuple(s.shape), s.dtype) for s in layers[layer]))
        structures.setdefault(key, []).append(layer)
    checked = {layer for members in structures.values() for layer in (members[0], members[1 % len(members)], members[-1])}
    if len(checked) == len(layers):
        return trace(specs)
    traced = trace([*rest, *(s for layer in sorted(checked) for s in layers[layer])])
    others = []
    for members in structures.values():
        first = members[0]
        for layer in {members[1 % len(members)], members[-1]} - {first}:
            if rename(traced, first, layer) != rename(traced, layer, layer):
                return trace(specs)
        for layer in members:
            if layer not in checked:
                renamed_trace = rename(traced, first, layer)
                if renamed_trace is None:
                    return trace(specs)
                others.append(renamed_trace)
    return merge([traced, *others])
