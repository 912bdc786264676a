"""The few trainer-wide collectives a session needs, over the default process group.

Without torch.distributed initialized the trainer is one process and each
collective is the identity.

On gloo the objects travel in tensors this module owns and keeps until gloo's worker
thread has let go of them. With torch's own `all_gather_object` the worker held the last
reference to tensors Python had created, and dropping it needs the interpreter's lock: where
the collective was the process's last (a refused connect, then `close()` and return), the
worker asked for the lock while the interpreter was finalizing, and the thread's exit ended
the process by SIGABRT ("terminate called without an active exception", 1 in 8 processes
here). Other backends keep torch's object collectives.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..core.gloo import is_gloo

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

#: How long to wait for gloo's worker to let go of a finished collective's tensors.
RELEASE_WAIT = 5.0


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
    if is_gloo(None):
        return _gloo_all_gather(dist, obj)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: T | None, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank (the others pass None)."""
    dist = _dist()
    if dist is None:
        return cast(T, obj)
    if is_gloo(None):
        return cast(T, _gloo_broadcast(dist, obj, src))
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return cast(T, box[0])


def _gloo_all_gather(dist: Any, obj: Any) -> list[Any]:
    import torch

    mine = _pickled(obj)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded)
    _released([size, *sizes, padded, *parts])
    return [_unpickled(part[: int(s)]) for part, s in zip(parts, sizes)]


def _gloo_broadcast(dist: Any, obj: Any, src: int) -> Any:
    import torch

    mine = _pickled(obj) if dist.get_rank() == src else None
    size = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src)
    payload = mine if mine is not None else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=src)
    _released([size, payload])
    return _unpickled(payload)


def _pickled(obj: Any) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def _released(tensors: list[torch.Tensor]) -> None:
    """Wait until this module holds the only reference to each of `tensors`: gloo's worker
    drops its own a moment after the collective completes."""
    deadline = time.monotonic() + RELEASE_WAIT
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(1e-4)
