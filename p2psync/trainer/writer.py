"""The pipelined writer: one write thread per engine.

A sender hands each filled buffer's writes to the threads of the engines they go
to and goes on filling the other buffer. Every write is bounded by
`transfer_timeout`; the first failure marks that engine failed and its later
writes are dropped. An engine that holds a buffer for longer than that (stuck,
or far slower than the rest) is failed and its hold on the buffer abandoned, so
it can delay the other engines by at most one `transfer_timeout`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .buffers import Lease
from ..core.errors import P2PSyncError, TransferError, where
from ..core.transport import Peer, WriteBatch
from ..core.types import TargetId

log = logging.getLogger(__name__)


@dataclass
class WriteJob:
    """Writes of one filled buffer to one engine rank; holds the buffer until released.
    `after`, if given, runs on the write thread once the bytes have landed, before the
    engine's next job (a delta patch's apply call)."""

    target: TargetId
    peer: Peer
    batch: WriteBatch
    lease: Lease
    after: Callable[[], None] | None = None
    submitted: float = field(default_factory=time.monotonic)
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        """Give the buffer back; later calls do nothing (a job can be abandoned and
        then finish)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self.lease.release()


@dataclass
class EngineProgress:
    """What the writes to one engine did in one update."""

    bytes: int = 0
    error: str | None = None
    last_done: float | None = None
    #: Bytes per engine rank: what each rank received (its own shard, not the full tensors).
    rank_bytes: dict[int, int] = field(default_factory=dict)
    #: (start, end) of each write that landed, on the monotonic clock: when bytes were moving.
    intervals: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class EngineWriter:
    """Executes the writes to one engine, in submission order, on its own thread."""

    engine_id: str
    timeout: float
    progress: EngineProgress = field(default_factory=EngineProgress)

    def __post_init__(self) -> None:
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._outstanding: list[WriteJob] = []
        self._idle = threading.Event()
        self._idle.set()
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
            self._outstanding.append(job)
            self._idle.clear()
        self._jobs.put(job)

    def holds_since(self, moment: float) -> bool:
        """Whether a job submitted at or before `moment` still holds its buffer."""
        with self._lock:
            return any(job.submitted <= moment and not job._released for job in self._outstanding)

    def abandon(self, error: str) -> None:
        """Fail the engine and give back every buffer its jobs hold, including one a
        transport may still be reading: whatever then lands there only reaches an
        engine that is failed and will not be resumed."""
        self.fail(error)
        with self._lock:
            jobs = list(self._outstanding)
        for job in jobs:
            job.release()

    def wait(self, margin: float = 5.0) -> None:
        """Wait for every submitted write.

        Each write is bounded by the transport's own timeout; should a transport
        overrun it by `margin` seconds, the engine is failed and not waited for.
        """
        while not self._idle.wait(0.05):
            if not self._thread.is_alive():
                self.abandon("the write thread stopped")
                return
            started = self._running_since
            if started is not None and time.monotonic() - started > self.timeout + margin:
                self.abandon(f"a write did not return within {self.timeout + margin:.1f} s")
                return

    @property
    def busy(self) -> bool:
        """Whether a submitted write has not returned yet."""
        return not self._idle.is_set()

    def successor(self) -> EngineWriter:
        """A writer on a new thread, for a write of an earlier update that is still inside
        its transport call (Mooncake's can block past its timeout on a connection TCP still
        retransmits on): this thread ends once that call returns, and holds nothing back."""
        self._jobs.put(None)
        return EngineWriter(self.engine_id, self.timeout)

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
                job.release()
                with self._lock:
                    self._outstanding.remove(job)
                    if not self._outstanding:
                        self._idle.set()

    def _write(self, job: WriteJob) -> None:
        start = time.monotonic()
        try:
            job.peer.write(job.batch, timeout=self.timeout)
        except TransferError as exc:
            log.warning("write to %s failed: %s", job.target, exc)
            self.fail(f"{where(job.target.engine_id, job.target.rank)}: {exc}")
            return
        except Exception as exc:  # a transport bug must fail this engine, not the thread
            log.exception("write to %s raised", job.target)
            self.fail(f"{where(job.target.engine_id, job.target.rank)}: {type(exc).__name__}: {exc}")
            return
        if job.after is not None and self.progress.error is None:  # an abandoned engine's buffer may be reused
            try:
                job.after()
            except P2PSyncError as exc:  # a failed apply fails this engine: its weights may be half patched
                log.warning("after the write to %s: %s", job.target, exc)
                self.fail(str(exc))
                return
        self.progress.bytes += job.batch.nbytes
        rank = job.target.rank
        self.progress.rank_bytes[rank] = self.progress.rank_bytes.get(rank, 0) + job.batch.nbytes
        self.progress.last_done = time.monotonic()
        self.progress.intervals.append((start, self.progress.last_done))
