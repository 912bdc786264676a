"""Buckets: which HF tensors the trainer gathers together.

Every input of a parameter group must arrive in the same bucket (a fused
`qkv_proj` needs q, k and v at once), across the layouts of all targets. Tensors
that some group ties together form one component; components are packed in the
trainer's order up to `bucket_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..core.errors import ConnectError
from ..core.layout import ParamGroup
from ..core.types import ParamSpec


def make_buckets(
    specs: Sequence[ParamSpec],
    groups: Iterable[ParamGroup],
    bucket_bytes: int,
    kind: Callable[[str], str] = lambda name: "",
) -> list[list[str]]:
    """Names to gather per bucket, in the trainer's order; only names some group reads.

    Tensors of different `kind` (a trainer's `bucket_kind`, e.g. experts, which
    Megatron gathers over another group) never share a bucket; each kind fills its
    own open bucket, so buckets stay full.
    """
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

    closed: list[list[str]] = []
    open_: dict[str, tuple[list[str], int]] = {}  # kind -> (names, bytes) of its bucket being filled
    for members in components.values():
        kinds = {kind(s.name) for s in members}
        if len(kinds) > 1:
            raise ConnectError(
                f"HF tensors {[s.name for s in members]} feed one engine parameter but are of different "
                f"bucket kinds {sorted(kinds)}"
            )
        (key,) = kinds
        nbytes = sum(s.nbytes for s in members)
        names, size = open_.get(key, ([], 0))
        if names and size + nbytes > bucket_bytes:
            closed.append(names)
            names, size = [], 0
        open_[key] = (names + [s.name for s in members], size + nbytes)
    return closed + [names for names, _ in open_.values()]
