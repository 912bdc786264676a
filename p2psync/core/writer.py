"""The pipelined writer: one write thread per engine.

A sender hands each filled buffer's writes to the threads of the engines they go
to and goes on filling the other buffer. Every write is bounded by
`transfer_timeout`; the first failure marks that engine failed and its later
writes are dropped, so one bad engine never holds the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .buffers import Lease
from .errors import TransferError
from .transport import Peer, WriteBatch
from .types import TargetId

log = logging.getLogger(__name__)


@dataclass
class WriteJob:
    target: TargetId
    peer: Peer
    batch: WriteBatch
    lease: Lease


@dataclass
class EngineProgress:
    """What the writes to one engine did in one update."""

    bytes: int = 0
    error: str | None = None
    last_done: float | None = None


@dataclass
class EngineWriter:
    """Executes the writes to one engine, in submission order, on its own thread."""

    engine_id: str
    timeout: float
    progress: EngineProgress = field(default_factory=EngineProgress)

    def __post_init__(self) -> None:
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._running_since: float | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"p2psync-write-{self.engine_id}", daemon=True)
        self._thread.start()

    def start_update(self) -> None:
        self.progress = EngineProgress()

    def fail(self, error: str) -> None:
        """Mark the engine failed; its queued and later writes are dropped."""
        if self.progress.error is None:
            self.progress.error = error

    def submit(self, job: WriteJob) -> None:
        job.lease.retain()
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put(job)

    def wait(self, margin: float = 5.0) -> None:
        """Wait for every submitted write.

        Each write is bounded by the transport's own timeout; should a transport
        overrun it by `margin` seconds, the engine is failed and not waited for.
        """
        while not self._idle.wait(0.05):
            started = self._running_since
            if started is not None and time.monotonic() - started > self.timeout + margin:
                self.fail(f"a write did not return within {self.timeout + margin:.1f} s")
                return

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout + 5)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self.progress.error is None:
                    self._running_since = time.monotonic()
                    self._write(job)
            finally:
                self._running_since = None
                job.lease.release()
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def _write(self, job: WriteJob) -> None:
        try:
            job.peer.write(job.batch, timeout=self.timeout)
        except TransferError as exc:
            log.warning("write to %s failed: %s", job.target, exc)
            self.fail(f"{job.target}: {exc}")
            return
        except Exception as exc:  # a transport bug must fail this engine, not the thread
            log.exception("write to %s raised", job.target)
            self.fail(f"{job.target}: {type(exc).__name__}: {exc}")
            return
        self.progress.bytes += job.batch.nbytes
        self.progress.last_done = time.monotonic()
