"""The gathering update's gathers, one bucket ahead of its production.

A gathering update is two kinds of work per bucket: the all-gathers (the network and
the trainer's collectives) and the production (a layout filling a transfer buffer). Run
in series they cost their sum; here a thread gathers bucket i + 1 while the update's
thread produces bucket i, so that an update costs about the larger of the two. At most
two buckets' tensors are held at once: the one being produced and the one being gathered.

Only this thread issues the trainer's collectives while the buckets go by (production,
the writers and the control calls issue none), so every rank's collectives keep one
order. On a GPU the gathers run on a stream of their own, and the consumer's stream waits
for each bucket's event before it reads the tensors (not run on this CPU-only machine).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Gather = Callable[[Sequence[str]], Mapping[str, "torch.Tensor"]]


class GatherAhead:
    """Iterates `(index, tensors)` over `buckets`, `gather` running one bucket ahead on a
    thread. Raises in the consumer what a gather raised; `close` stops the thread before
    its next gather (a gather under way finishes: the other ranks are in it too)."""

    def __init__(self, gather: Gather, buckets: Sequence[Sequence[str]], *, name: str = "p2psync-gather") -> None:
        self._gather, self._buckets = gather, buckets
        self._ready: queue.Queue[tuple[int, Mapping[str, torch.Tensor] | None, BaseException | None, Any]] = (
            queue.Queue()
        )
        self._slots = threading.Semaphore(2)  # buckets alive at once: produced and gathered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def __iter__(self) -> Iterator[tuple[int, Mapping[str, torch.Tensor]]]:
        if not self._buckets:  # nothing to gather (every group went gather-free): no thread
            return
        if not self._started:
            self._started = True
            self._thread.start()
        for _ in self._buckets:
            index, tensors, error, event = self._ready.get()
            if error is not None:
                raise error
            assert tensors is not None
            _wait_on_current_stream(event, tensors)
            try:
                yield index, tensors
            except GeneratorExit:  # the consumer stopped early: no further gathers
                self._stop.set()
                raise
            finally:
                del tensors
                self._slots.release()  # the consumer is done with this bucket

    def close(self) -> None:
        """Stop gathering further buckets and wait for the thread."""
        self._stop.set()
        self._slots.release()
        if self._started:
            self._thread.join()

    def _run(self) -> None:
        stream = _side_stream()
        for index, names in enumerate(self._buckets):
            self._slots.acquire()
            if self._stop.is_set():
                return
            try:
                with _on(stream):
                    tensors = self._gather(names)
                    event = _recorded(stream)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer's thread
                self._ready.put((index, None, exc, None))
                return
            self._ready.put((index, tensors, None, event))
            del tensors


def _side_stream() -> Any:
    """A CUDA stream for the gathers where CUDA runs here, else None."""
    import torch

    return torch.cuda.Stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _on(stream: Any) -> Any:
    import contextlib

    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _recorded(stream: Any) -> Any:
    return stream.record_event() if stream is not None else None


def _wait_on_current_stream(event: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make the consumer's stream wait for the gathers' event, and tell the allocator that
    the consumer's stream uses the gathered tensors (their memory is not reused before it is
    done)."""
    if event is None:
        return
    import torch

    current = torch.cuda.current_stream()
    current.wait_event(event)
    for tensor in tensors.values():
        if tensor.is_cuda:
            tensor.record_stream(current)
