"""Parameter groups from a relation between HF tensors and the engine parameters they feed.

Engine adapters learn, by probing their loaders, which HF tensors each engine
parameter is written from (q, k, v -> qkv_proj; gate, up -> gate_up_proj; every
expert -> w13). Tensors that feed one parameter, and parameters fed by one tensor,
must be produced together: they form one group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def connected_groups(
    edges: Iterable[tuple[str, str]], inputs: Sequence[str], outputs: Sequence[str]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The connected components of `edges` (input, output), as (inputs, outputs).

    Each component lists its inputs in `inputs` order and its outputs in `outputs`
    order; components come in the order of their first output. Names in no edge
    are left out.
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
