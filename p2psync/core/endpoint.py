"""The engine-side endpoint and its trainer-side control client.

An endpoint runs inside an engine worker (one per rank): it registers exactly
the rank's parameter memory with the transport, publishes the target table, and
serves the control calls `pause`, `finish`, `digest`. Adapters whose engine has
no control API of its own (a plain torch module, a worker without a server) use
it as is; the callables say what pausing and resuming mean for that engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .control import ControlServer, post
from .digest import byte_view, digest
from .engine import EngineControl
from .errors import ControlError, where
from .types import Region, TargetParam, TargetTable

if TYPE_CHECKING:
    import torch

    from .rendezvous import Rendezvous
    from .transport import Transport

log = logging.getLogger(__name__)


def _nothing() -> None:
    return None


@dataclass
class EngineHooks:
    """What the engine does at each control call. Defaults do nothing."""

    pause: Callable[[], None] = _nothing
    post_process: Callable[[], None] = _nothing
    flush_cache: Callable[[], None] = _nothing
    resume: Callable[[], None] = _nothing
    #: Extra routes, e.g. {"generate": fn(body) -> dict}, served beside the standard ones.
    routes: Mapping[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = field(default_factory=dict)


class EngineEndpoint:
    """Exposes one engine rank's parameters to trainers."""

    def __init__(
        self,
        *,
        engine: str,
        engine_id: str,
        rank: int,
        world_size: int,
        params: Mapping[str, torch.Tensor],
        layout_key: dict[str, Any],
        transport: Transport,
        rendezvous: Rendezvous,
        hooks: EngineHooks | None = None,
        host: str = "127.0.0.1",
        token: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        for name, tensor in params.items():
            if not tensor.is_contiguous():
                raise ValueError(f"{where(engine_id, rank, name)} is not contiguous; its bytes cannot be written in place")
        self.engine = engine
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.params = dict(params)
        self.layout_key = layout_key
        self.transport = transport
        self.rendezvous = rendezvous
        self.hooks = hooks or EngineHooks()
        self.host = host
        self.token = rendezvous.token() if token is None else token
        self.extra = dict(extra or {})
        self.version: str | None = None
        self.paused = False
        self._lock = threading.Lock()
        self._server: ControlServer | None = None

    @classmethod
    def serve(
        cls, *, transport: Transport | str, transport_options: Mapping[str, Any] | None = None, **fields: Any
    ) -> EngineEndpoint:
        """Create an endpoint over `transport` (an instance, or a registered name built with
        `transport_options`) and start it: what every engine adapter's `serve` does."""
        from .plugins import registry

        transport = registry().make_transport(transport, transport_options)
        endpoint = cls(transport=transport, **fields)
        endpoint.start()
        return endpoint

    def start(self) -> TargetTable:
        """Register the parameter memory, start serving control calls, publish the table."""
        self.transport.bind(self.rendezvous)
        info = self.transport.expose(list(self.params.values()))
        routes = {"pause": self._pause, "finish": self._finish, "digest": self._digest, "info": self._info}
        routes.update(self.hooks.routes)
        self._server = ControlServer(routes, host=self.host, token=self.token)
        table = TargetTable(
            engine_id=self.engine_id,
            rank=self.rank,
            world_size=self.world_size,
            engine=self.engine,
            layout_key=self.layout_key,
            transport=self.transport.name,
            transport_info=info,
            control_url=self._server.url,
            params=tuple(
                TargetParam(
                    name=name,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    addr=t.data_ptr(),
                    nbytes=t.numel() * t.element_size(),
                )
                for name, t in self.params.items()
            ),
            job_id=self.rendezvous.job_id,
            extra=self.extra,
        )
        self.rendezvous.publish(table)
        return table

    def close(self) -> None:
        """Withdraw the table, stop serving control calls, unregister the memory."""
        self.rendezvous.unpublish(self.engine_id, self.rank)
        if self._server is not None:
            self._server.close()
            self._server = None
        self.transport.close()

    def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.hooks.pause()
            self.paused = True
        return {"paused": True}

    def _finish(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.hooks.post_process()
            self.hooks.flush_cache()
            self.version = str(body["version"])
            self.hooks.resume()
            self.paused = False
        log.info("rank %d: serving weight version %s", self.rank, self.version)
        return {"version": self.version}

    def _digest(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, spans in body["regions"].items():
            if name not in self.params:
                raise KeyError(f"no parameter {name!r} on this rank")
            out[name] = digest(byte_view(self.params[name]), spans)
        return {"digests": out}

    def _info(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"version": self.version, "paused": self.paused, "rank": self.rank}


class EndpointControl(EngineControl):
    """Trainer-side client of the endpoints of one engine's ranks."""

    def __init__(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> None:
        self.tables = sorted(tables, key=lambda t: t.rank)
        self.timeout = timeout
        self.token = token

    def _call(self, table: TargetTable, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return post(table.control_url, route, body, token=self.token, timeout=self.timeout)
        except ControlError as exc:
            raise ControlError(f"{where(table.engine_id, table.rank)}: {exc}") from exc

    def check_access(self) -> None:
        for table in self.tables:
            self._call(table, "info")

    def pause(self) -> None:
        for table in self.tables:
            self._call(table, "pause")

    def finish(self, version: str) -> None:
        for table in self.tables:
            self._call(table, "finish", {"version": version})

    def digests(self, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        spans = {name: [[r.param_offset, r.nbytes] for r in rs] for name, rs in regions.items()}
        return self._call(self.tables[rank], "digest", {"regions": spans})["digests"]

    def info(self, rank: int) -> dict[str, Any]:
        return self._call(self.tables[rank], "info")
