"""The few trainer-wide collectives a session needs, over the default process group.

Without torch.distributed initialized the trainer is one process and each
collective is the identity.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

T = TypeVar("T")


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def all_gather(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order."""
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: T | None, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank (the others pass None)."""
    dist = _dist()
    if dist is None:
        return cast(T, obj)
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return cast(T, box[0])
