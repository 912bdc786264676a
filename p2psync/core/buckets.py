"""Buckets: which HF tensors the trainer gathers together.

Every input of a parameter group must arrive in the same bucket (a fused
`qkv_proj` needs q, k and v at once), across the layouts of all targets. Tensors
that some group ties together form one component; components are packed in the
trainer's order up to `bucket_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .layout import ParamGroup
from .types import ParamSpec


def make_buckets(specs: Sequence[ParamSpec], groups: Iterable[ParamGroup], bucket_bytes: int) -> list[list[str]]:
    """Names to gather per bucket, in the trainer's order; only names some group reads."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for group in groups:
        for name in group.inputs:
            parent.setdefault(name, name)
        root = find(group.inputs[0])
        for name in group.inputs[1:]:
            parent[find(name)] = root

    order = [s for s in specs if s.name in parent]
    components: dict[str, list[ParamSpec]] = {}
    for spec in order:
        components.setdefault(find(spec.name), []).append(spec)

    buckets: list[list[str]] = []
    size = 0
    for members in components.values():
        nbytes = sum(s.nbytes for s in members)
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].extend(s.name for s in members)
            size += nbytes
        else:
            buckets.append([s.name for s in members])
            size = nbytes
    return buckets
