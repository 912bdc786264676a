"""The Transport protocol: one-sided writes from trainer buffers into engine memory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .host import local_host
from .options import NoOptions, parse
from .types import TargetTable

if TYPE_CHECKING:
    import torch

    from .rendezvous import Rendezvous


@dataclass
class WriteBatch:
    """Writes to one peer, as the parallel lists that batched transport APIs take.

    `add` merges a write into the previous one where both the local and the remote
    ranges continue it, so parameters that sit back to back cost one descriptor.
    """

    local: list[int] = field(default_factory=list)
    remote: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add(self, local: int, remote: int, length: int) -> None:
        if length <= 0:
            return
        if self.lengths and self.local[-1] + self.lengths[-1] == local and self.remote[-1] + self.lengths[-1] == remote:
            self.lengths[-1] += length
            return
        self.local.append(local)
        self.remote.append(remote)
        self.lengths.append(length)

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)


class Peer(ABC):
    """The trainer's handle on one engine rank's registered memory."""

    @abstractmethod
    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        """Write every range of `batch`, returning once all have landed.

        Raises TransferTimeout when they have not landed within `timeout` seconds and
        TransferError when the transport reports a failure. Must never block longer
        than `timeout` (plus polling granularity).
        """

    def close(self) -> None:
        """Release what `Transport.open` set up for this peer."""


class Transport(ABC):
    """A way to move bytes from trainer buffers into registered engine memory.

    One instance per process. Both sides first `bind` it to the job's
    rendezvous. The engine side calls `expose` with its parameter memory and
    publishes the returned info in its target table (where the transport can `conceal`
    it, it conceals it between updates and exposes it again at each pause); the trainer
    side registers its transfer buffers once with `register_buffer` and opens a `Peer`
    per engine rank it serves. Memory is passed as tensors so that a transport can tell host
    from device memory and, where it must receive (two-sided transports), write
    into them.

    Constructed with `options`: a mapping (or an instance) of the `Options` dataclass
    the class declares, parsed before anything binds, so that a misspelt option fails
    at once with the valid ones named.
    """

    name: ClassVar[str]
    #: Modules that must import for this transport to work (checked by `p2psync plugins`).
    requires: ClassVar[tuple[str, ...]] = ()
    #: Kinds of memory it writes into ("cpu", "cuda"); the conformance suite tests each.
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: The options this transport takes (a frozen dataclass).
    Options: ClassVar[type] = NoOptions

    def __init__(self, *, options: Mapping[str, Any] | object | None = None) -> None:
        self.options: Any = parse(self.Options, options, what=f"transport {self.name!r}")
        self.rendezvous: Rendezvous | None = None

    def bind(self, rendezvous: Rendezvous) -> None:
        """Attach the job's rendezvous, for transports that set up more than the
        published info carries (the torch.distributed transport builds its groups
        there). Called once, before `expose` or `open`."""
        self.rendezvous = rendezvous

    def local_host(self, named: str | None = None) -> str:
        """The address peers reach this process's sockets at: `named` (the transport's `host`
        option) where set, else `core.host.local_host` toward the rendezvous host."""
        return named or local_host(toward=self.rendezvous.host if self.rendezvous is not None else None)

    @abstractmethod
    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Engine side: register the memory of `tensors` (contiguous) as write
        targets; return the JSON-serializable info a trainer needs to reach them."""

    def conceal(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Engine side: refuse every remote write into `tensors` and every remote read of them
        until `expose` is called with them again (which opens them and returns the info for the
        table). The endpoint conceals its memory whenever no update holds the engine paused, so
        that a process that reaches this transport's port, job token or not, can neither change
        what the engine serves nor read its weights. False where this transport cannot (the
        default): its memory stays open to whoever reaches it outside updates too, and the
        endpoint looks for bytes changed outside an update instead (`EngineEndpoint`)."""
        return False

    def fence(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        """Engine side, before an update that follows one that never finished: make sure no
        write begun before this call lands after it (a write the trainer gave up on may still
        be on its way: a TCP connection that stalled delivers once it resumes), expose
        `tensors` again and return the new info for the table. None where this transport
        cannot (the default): such a late write is then caught only by a digest check."""
        return None

    @abstractmethod
    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Trainer side: register a transfer buffer that writes will read from."""

    @abstractmethod
    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        """Trainer side: forget a buffer given to `register_buffer`."""

    @abstractmethod
    def open(self, table: TargetTable) -> Peer:
        """Trainer side: connect to the engine rank that published `table`."""

    @abstractmethod
    def close(self) -> None:
        """Unregister all memory and stop the transport's own threads."""

    def describe(self) -> dict[str, Any]:
        """What was really selected (protocol, devices), for reports and logs."""
        return {"transport": self.name}
