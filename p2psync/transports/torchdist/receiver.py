"""Engine side: accept pair requests and receive each write straight into parameter memory.

A write arrives as a header over the pair's gloo group (range count and the
sender's time left in ms; then every range's address and length), then one
message per range, in the header's order, received into a view of the exposed
tensor that holds it. Receives are posted in exactly the order the sender
sends, so they always match. A one-element ack (the bytes received) tells the
sender they have landed. Any error closes the pair (see pair.py); the trainer
reconnects, and the new pair closes what is left of the old one, so bytes of an
abandoned write never land after those of a newer one.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...core.memory import AddressMap, scatter
from .pair import ENGINE, TAG, TRAINER, Pair, channel_key, own_connection

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger(__name__)

#: How long the listener's store wait lasts before it looks again (close() wakes it sooner).
LISTEN = timedelta(hours=1)


class Receiver:
    """Serves one engine rank's exposed memory on `channel` to any number of trainer senders."""

    def __init__(
        self, store: dist.Store, channel: str, memory: AddressMap, device: torch.device, *, host: str, timeout: float
    ) -> None:
        self.store = store
        self.channel = channel
        self.memory = memory
        self.device = device
        self.host = host
        self.timeout = timeout
        self._next = 1
        self._closed = False
        self._pairs: dict[str, Pair] = {}  # by sender: a trainer peer's newest pair
        #: While set, every write is refused (its pair closes, none of its bytes lands).
        self.concealed = False
        self._lock = threading.Lock()
        self._listener = threading.Thread(target=self._listen, name=f"p2psync-torchdist-{channel}", daemon=True)
        self._servers: list[threading.Thread] = []

    def start(self) -> None:
        self._listener.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting trainers (wake the listener with the key it waits for) and
        close every pair, so that no byte lands after the engine closed its transport.

        Then wait for the threads: one still inside a torch call when the interpreter
        exits terminates the process as it comes back.
        """
        with self._lock:
            self._closed = True
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()
        try:
            self.store.set(channel_key(self.channel, f"request/{self._next}"), "")
        except RuntimeError as exc:  # the rendezvous is gone: the listener's wait fails on its own
            log.debug("waking the torchdist listener: %s", exc)
        deadline = time.monotonic() + timeout
        for thread in [self._listener, *self._servers]:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("torchdist thread %s still running after close", thread.name)

    def _listen(self) -> None:
        import torch.distributed as dist

        store = own_connection(self.store)
        while not self._closed:
            key = channel_key(self.channel, f"request/{self._next}")
            try:
                store.wait([key], LISTEN)
                sender = store.get(key).decode()
            except dist.DistStoreError:  # the wait timed out
                continue
            except RuntimeError as exc:
                log.warning("torchdist channel %s stops accepting trainers: %s", self.channel, exc)
                return
            if self._closed:
                return
            n = self._next
            self._next += 1
            thread = threading.Thread(target=self._serve, args=(n, sender), name=f"p2psync-torchdist-{n}", daemon=True)
            self._servers = [t for t in self._servers if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, n: int, sender: str) -> None:
        import torch.distributed as dist

        try:
            pair = Pair.connect(
                dist.PrefixStore(channel_key(self.channel, f"pair/{n}/"), own_connection(self.store)),
                ENGINE,
                host=self.host,
                timeout=self.timeout,
                nccl=self.device.type == "cuda",
            )
        except RuntimeError as exc:
            log.warning("torchdist pair %d with %s not connected: %s", n, sender, exc)
            return
        with self._lock:
            old = self._pairs.pop(sender, None)
            if not self._closed:
                self._pairs[sender] = pair
        if old is not None:
            old.close()
        if self._closed:
            pair.close()
            return
        log.info("torchdist pair %d with %s connected", n, sender)
        try:
            while True:
                self._receive(pair)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            log.info("torchdist pair %d with %s closed: %s", n, sender, exc)
        finally:
            with self._lock:
                if self._pairs.get(sender) is pair:
                    del self._pairs[sender]
            pair.close()

    def _receive(self, pair: Pair) -> None:
        """One write: header, ranges, ack."""
        import torch

        head = torch.empty(2, dtype=torch.int64)
        pair.wait(pair.control.recv([head], TRAINER, TAG), None)
        count, left_ms = head.tolist()
        deadline = time.monotonic() + left_ms / 1000
        ranges = torch.empty(2 * count, dtype=torch.int64)
        pair.wait(pair.control.recv([ranges], TRAINER, TAG), deadline)
        addrs, lengths = ranges[:count].tolist(), ranges[count:].tolist()
        if self.concealed:  # no update holds the engine paused (ValueError: the pair closes)
            raise ValueError(f"a write of {sum(lengths)} bytes while the engine's memory is concealed")
        # Refuses any byte outside the exposed tensors (ValueError: the pair closes).
        landing = [self.memory.pieces(a, n) for a, n in zip(addrs, lengths)]
        posted: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        for pieces, n in zip(landing, lengths):
            # A range over two allocations that happen to touch lands in a staging buffer first.
            into = pieces[0] if len(pieces) == 1 else torch.empty(n, dtype=torch.uint8, device=self.device)
            posted.append((pair.data.recv([into], TRAINER, TAG), into, pieces))
        for work, into, pieces in posted:
            pair.wait(work, deadline)
            if len(pieces) > 1:
                scatter(into, pieces)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        pair.wait(pair.control.send([torch.tensor([sum(lengths)], dtype=torch.int64)], TRAINER, TAG), deadline)
