"""Adapter slots of one engine rank: each adapter it serves is an engine id of its own
(`prefix + adapter`), so that each has its own version and lease, and an update of one
pauses only the requests routed to that adapter's endpoint."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing import Unpack

    from ..core.rendezvous import Rendezvous
    from .endpoint import EngineEndpoint
    from .hooks import EndpointOptions


class AdapterSlots(ABC):
    """The adapter slots of one engine rank, served and withdrawn while it serves, each over a
    transport of its own (`transport`, a registered name: closing a slot closes its own).
    Engine adapters say how a slot is published (`_publish`) and how the engine forgets an
    adapter (`_forget`); loading a new adapter is theirs too (its arguments differ by engine)."""

    def __init__(
        self, *, rendezvous: Rendezvous, transport: str, prefix: str = "", rank: int = 0, world_size: int = 1,
    ) -> None:
        self.rendezvous, self.transport, self.prefix = rendezvous, transport, prefix
        self.rank, self.world_size = rank, world_size
        self.endpoints: dict[str, EngineEndpoint] = {}

    @abstractmethod
    def _publish(self, adapter: str, engine_id: str, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        """Serve the slot of `adapter`, which the engine holds, as `engine_id`."""

    @abstractmethod
    def _forget(self, adapter: str) -> None:
        """Delete `adapter` from the engine (its slot is withdrawn already)."""

    def serve(self, adapter: str, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        """Serve an adapter the engine already holds (`options` as the engine's `serve`)."""
        if adapter in self.endpoints:
            raise ValueError(f"adapter {adapter!r} is served already, as {self.endpoints[adapter].engine_id!r}")
        self.endpoints[adapter] = self._publish(adapter, self.prefix + adapter, **options)
        return self.endpoints[adapter]

    def _load_new(
        self, adapter: str, load: Callable[[], None], *, engine: str, held: int, limit: int, limit_flag: str,
        **options: Unpack[EndpointOptions],
    ) -> EngineEndpoint:
        """Load a new adapter with the engine's own loader (`load`), then serve it. Refused,
        naming the rank and adapter, where the engine holds `limit` adapters already (its
        `limit_flag`), and with the loader's reason where it raises ValueError."""
        if held >= limit:
            raise ValueError(f"rank {self.rank}: cannot load LoRA adapter {adapter!r}: the engine holds {held} "
                             f"adapters, its {limit_flag}")
        try:
            load()
        except ValueError as exc:
            raise ValueError(f"rank {self.rank}: {engine} refused LoRA adapter {adapter!r}: {exc}") from None
        return self.serve(adapter, **options)

    def unload(self, adapter: str) -> None:
        """Withdraw the slot, then delete the adapter from the engine. Unload between updates:
        the slot's memory is unregistered first, so the writes of an update in flight fail."""
        self.endpoints.pop(adapter).close()
        self._forget(adapter)

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        self.endpoints.clear()


class EngineRank(Protocol):
    """One rank of an engine with its own LoRA manager, as its slots see it."""

    rank: int

    @property
    def world_size(self) -> int: ...


class EngineRankSlots(AdapterSlots):
    """The adapter slots of one rank of an engine that manages adapters itself (sglang's,
    vLLM's LoRA managers): `lora`, the rank, gives the slots' rank and world size."""

    def __init__(self, lora: EngineRank, *, rendezvous: Rendezvous, transport: str, prefix: str = "") -> None:
        super().__init__(rendezvous=rendezvous, transport=transport, prefix=prefix, rank=lora.rank,
                         world_size=lora.world_size)
