"""Transfer buffers: two per sender, registered once, reused only when no write reads them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import TransferTimeout

if TYPE_CHECKING:
    import torch

    from ..core.transport import Transport


class Lease:
    """A buffer taken for filling; free again once the filler and every write that
    reads it have released it."""

    def __init__(self, pool: BufferPool, index: int) -> None:
        self._pool = pool
        self.index = index
        self._refs = 1  # the filler's own reference
        self._lock = threading.Lock()

    @property
    def tensor(self) -> torch.Tensor:
        return self._pool.tensors[self.index]

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    def retain(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("retain on a released buffer lease")
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            free = self._refs == 0
            if self._refs < 0:
                raise RuntimeError("buffer lease released more often than retained")
        if free:
            self._pool._give_back(self.index)


class BufferPool:
    """`count` buffers of `nbytes`, registered with the transport once.

    `pin_memory` allocates page-locked host memory, which GPU transports read
    fastest; `device` puts the buffers in device memory where the transport can
    read it (RDMA with GPUDirect).
    """

    def __init__(
        self,
        nbytes: int,
        transport: Transport,
        *,
        count: int = 2,
        device: str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        import torch

        self.nbytes = nbytes
        self.tensors = [
            torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pin_memory) for _ in range(count)
        ]
        for t in self.tensors:
            transport.register_buffer(t)
        self._transport = transport
        self._free = list(range(count))
        self._cond = threading.Condition()

    def close(self) -> None:
        """Unregister the buffers; call only once every lease is released."""
        for t in self.tensors:
            self._transport.unregister_buffer(t)
        self.tensors = []

    def acquire(self, timeout: float, on_stall: Callable[[float], None] | None = None) -> Lease:
        """A free buffer, waiting at most `timeout` seconds for writes to release one.

        If none is released by then, `on_stall(wait_started)` may abandon the writes
        that hold the buffers (those submitted before the wait began); then one more
        short wait follows before TransferTimeout.
        """
        started = time.monotonic()
        with self._cond:
            if self._wait_free(started + timeout):
                return Lease(self, self._free.pop(0))
        if on_stall is not None:
            on_stall(started)
            with self._cond:
                if self._wait_free(time.monotonic() + 1.0):
                    return Lease(self, self._free.pop(0))
        raise TransferTimeout(f"no transfer buffer was released within {timeout:.1f} s")

    def _wait_free(self, deadline: float) -> bool:
        while not self._free:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def wait_all_free(self, timeout: float) -> bool:
        """Wait until every buffer is free again; False if that took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._free) < len(self.tensors):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _give_back(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify_all()
