"""Rendezvous over torch.distributed's TCPStore: engines publish tables, trainers read them.

Keys live under `p2psync/<job_id>/`, so several jobs can share one store.
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING

from .errors import RendezvousError
from .types import TargetTable

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)


class Rendezvous:
    """A namespaced view of a TCPStore.

    `is_server=True` hosts the store in this process (port 0 picks a free port);
    everyone else connects to `host:port`. The host also creates the job's secret
    token (or takes `token`); engines check it on every control call, so a trainer
    of another job, or one given another token, is refused.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        job_id: str,
        is_server: bool = False,
        timeout: float = 60.0,
        store: dist.Store | None = None,
        token: str | None = None,
    ) -> None:
        import torch.distributed as dist

        if not job_id or "/" in job_id:
            raise ValueError(f"job id must be a non-empty name without '/', got {job_id!r}")
        self.job_id = job_id
        self.timeout = timeout
        if store is None:
            store = dist.TCPStore(
                host, port, is_master=is_server, timeout=timedelta(seconds=timeout), wait_for_workers=False
            )
        self._root = store
        self.host = host
        self.port = store.port if hasattr(store, "port") else port
        self.store = dist.PrefixStore(f"p2psync/{job_id}/", store)
        if is_server:
            self.store.set("token", token or secrets.token_hex(16))

    def token(self) -> str:
        """The job's secret token, as the rendezvous host set it."""
        return self._get("token", None, self.timeout).decode()

    def publish(self, table: TargetTable) -> None:
        """Publish one engine rank's table (replacing an older one of the same rank)."""
        prefix = f"engine/{table.engine_id}"
        self.store.set(f"{prefix}/world_size", str(table.world_size))
        self.store.set(f"{prefix}/rank/{table.rank}", table.to_json())
        log.info("published target table of %s rank %d (%d parameters)", table.engine_id, table.rank, len(table.params))

    def unpublish(self, engine_id: str, rank: int) -> None:
        """Withdraw one engine rank's table (on a clean shutdown), so that trainers
        connecting later wait for its successor instead of reaching a dead rank."""
        self.store.delete_key(f"engine/{engine_id}/rank/{rank}")

    def read_engine(self, engine_id: str, timeout: float | None = None) -> list[TargetTable]:
        """Every rank's table of one engine, waiting up to `timeout` for them to appear."""
        timeout = self.timeout if timeout is None else timeout
        prefix = f"engine/{engine_id}"
        world_size = int(self._get(f"{prefix}/world_size", engine_id, timeout))
        tables = []
        for rank in range(world_size):
            table = TargetTable.from_json(self._get(f"{prefix}/rank/{rank}", engine_id, timeout))
            if (table.engine_id, table.rank, table.world_size) != (engine_id, rank, world_size):
                raise RendezvousError(
                    f"rendezvous key of engine {engine_id!r} rank {rank} holds the table of engine "
                    f"{table.engine_id!r} rank {table.rank} of {table.world_size}"
                )
            tables.append(table)
        return tables

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._get(key, None, self.timeout if timeout is None else timeout)

    def _get(self, key: str, engine_id: str | None, timeout: float) -> bytes:
        try:
            self.store.wait([key], timedelta(seconds=timeout))
            return self.store.get(key)
        except Exception as exc:  # TCPStore raises DistStoreError / RuntimeError on timeout
            who = f" of engine {engine_id!r}" if engine_id else ""
            raise RendezvousError(
                f"rendezvous key {key!r}{who} (job {self.job_id!r}) not available within {timeout:.0f} s: {exc}"
            ) from exc
