"""One standalone two-rank group per (trainer sender, engine rank), built in the rendezvous store.

The trainer's default process group is its own business, so no
`init_process_group` here: each pair gets a `ProcessGroupGloo` of its own
(rank 0 the trainer, rank 1 the engine) under a key prefix of the job's store,
plus a `ProcessGroupNCCL` for the bytes when the engine's parameters are on a
GPU. Headers and acks always go over gloo, so an idle engine waits for the next
write on a CPU socket, never inside an NCCL kernel.

A gloo pair must see exactly the receives its peer's sends expect: a size
mismatch terminates the process. So a pair is never used again after any error;
both sides close it and the trainer connects a new one.

Store keys, under `torchdist/<channel>/` of the job's store (the channel is the
engine rank's, published in its target table): `requests` counts connection
requests, `request/<n>` names the trainer of request n, `pair/<n>/` holds that
pair's group rendezvous.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

TRAINER, ENGINE = 0, 1
TAG = 0
#: How long an idle engine waits for the next write on a pair; then it closes the
#: pair and the trainer connects a new one at its next write.
IDLE = timedelta(days=7)


def channel_key(channel: str, key: str) -> str:
    return f"torchdist/{channel}/{key}"


def own_connection(store: dist.Store) -> dist.Store:
    """A new client of `store`'s server, for a thread whose blocking waits must not hold up the others."""
    return store.clone()  # type: ignore[attr-defined]  # Store.clone is bound, absent from torch's stub


@dataclass(eq=False)  # pairs are compared and hashed by identity
class Pair:
    """The groups of one pair: `control` (gloo) carries headers and acks, `data`
    the bytes (the gloo group itself on CPU, NCCL on GPUs)."""

    control: Any
    data: Any
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, *, host: str, timeout: float, nccl: bool) -> Pair:
        """Build both groups; blocks until the peer joins or `timeout` seconds pass."""
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # bound, absent from torch's stub
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timedelta(seconds=timeout)
        options._threads = 1  # point to point only: the worker threads serve collectives
        control = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, 2, options)
        if not nccl:
            return cls(control, control)
        # UNTESTED (no GPU here). NCCL cannot pair two ranks on one GPU: use samehost for colocated engines.
        if not dist.is_nccl_available():
            raise RuntimeError("the engine's parameters are on a GPU, but this torch build has no NCCL")
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timedelta(seconds=timeout)
        return cls(control, dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, nccl_options))

    def wait(self, work: Any, deadline: float | None) -> None:
        """Wait for `work` until `deadline` (time.monotonic; None: up to IDLE). Raises
        TimeoutError when late, RuntimeError when the group failed or was closed (a
        wait that an abort ends returns as if it had succeeded)."""
        left = IDLE.total_seconds() if deadline is None else deadline - time.monotonic()
        try:
            done = left > 0 and work.wait(timedelta(seconds=left))
        except RuntimeError as exc:  # gloo reports its own timeout as a RuntimeError
            if deadline is not None and time.monotonic() >= deadline - 1e-3:
                raise TimeoutError(str(exc)) from exc
            raise
        if self.closed:
            raise RuntimeError("the pair was closed")
        if not done:
            raise TimeoutError("not done in time")

    def close(self) -> None:
        """Drop both groups; the peer's pending operations fail with 'connection closed'.
        Idempotent, and safe from any thread (gloo's abort is not, twice at once)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for group in {id(self.control): self.control, id(self.data): self.data}.values():
                try:
                    group.abort()
                except RuntimeError as exc:
                    log.debug("closing a torchdist group: %s", exc)
