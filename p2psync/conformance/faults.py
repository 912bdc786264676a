"""Faults the suite injects to show that a check catches them.

`corrupting(Transport, victim)`: a transport class whose every write to one engine rank is
followed by one wrong byte at the first address it wrote, as a transport that corrupts data
in flight or a rank that scribbles on its weights after the writes would leave them. The
update's digest check must then report that engine stale, by name, and leave it paused.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..core.transport import Peer, Transport, WriteBatch
from ..core.types import TargetId, TargetTable


class CorruptingPeer(Peer):
    """A peer that writes what it is asked to, then one wrong byte over the first one."""

    def __init__(self, peer: Peer, transport: Any) -> None:
        self.peer = peer
        self.transport = transport

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        self.peer.write(batch, timeout=timeout)
        if not self.transport.armed or not batch.lengths:
            return
        wrong = self.transport.wrong_byte
        wrong[0] = ctypes.string_at(batch.local[0], 1)[0] ^ 0xFF
        one = WriteBatch()
        one.add(wrong.data_ptr(), batch.remote[0], 1)
        self.peer.write(one, timeout=timeout)

    def close(self) -> None:
        self.peer.close()


def corrupting(cls: type[Transport], victim: TargetId) -> type[Transport]:
    """A subclass of `cls` whose writes to `victim` are corrupted while `armed` is true."""

    class Corrupting(cls):  # type: ignore[valid-type, misc]
        armed = False

        def open(self, table: TargetTable) -> Peer:
            peer = super().open(table)
            if table.target != victim:
                return peer
            if not hasattr(self, "wrong_byte"):
                import torch

                self.wrong_byte = torch.zeros(64, dtype=torch.uint8)  # registered like a transfer buffer
                self.register_buffer(self.wrong_byte)
            return CorruptingPeer(peer, self)

    Corrupting.__name__ = f"Corrupting{cls.__name__}"
    return Corrupting
