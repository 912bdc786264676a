"""Rendezvous over torch.distributed's TCPStore: engines publish tables, trainers read them.

Keys live under `p2psync/<job_id>/`, so several jobs can share one store. Every wait
honours the configured timeout and fails with a RendezvousError naming host, port,
job and the key awaited: the store is reached only once something listens at its
address (torch's own client retries for about twice its timeout and logs each
attempt), and keys are polled rather than waited for inside the store client (whose
timeouts log C++ warnings).

An engine rank's table is also its claim on the engine id: `publish` succeeds only
where no table is held (or where it replaces the one the caller names), so two live
processes never serve one engine id unnoticed (see `EngineEndpoint`).
"""

from __future__ import annotations

import logging
import math
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from .errors import RendezvousError, first_line
from .token import job_token
from .types import TargetTable

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

#: Seconds between polls of a key that is not there yet (doubling up to the second figure).
POLL = (0.02, 0.25)
#: Seconds into a wait for the rendezvous to listen when it is first said (then doubling, at
#: most the second figure apart).
SAY_WAITING, SAY_WAITING_MAX = 5.0, 300.0


class Rendezvous:
    """A namespaced view of a TCPStore.

    `is_server=True` hosts the store in this process (port 0 picks a free port), listening on
    `host` only (`listen_on`), the address its peers use, not on every interface;
    everyone else connects to `host:port` when first needed, waiting at most `timeout`
    for it to listen (`patient=True`: as long as it takes, saying so now and then, as an
    engine that outlives its trainers waits for the next). `token()` is the job's
    secret token (`token`, else `core.token.job_token`): engines check it on every control
    call, so a trainer of another job, or one given another token, is refused. It never
    travels through the store.
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
        patient: bool = False,
    ) -> None:
        import torch.distributed as dist

        if not job_id or "/" in job_id:
            raise ValueError(f"job id must be a non-empty name without '/', got {job_id!r}")
        self.job_id = job_id
        self.timeout = timeout
        self.patient = patient
        self.host = host
        if store is None and is_server:
            listening = listen_on(host, port)
            store = dist.TCPStore(
                host, listening.getsockname()[1], is_master=True, timeout=timedelta(seconds=timeout),
                wait_for_workers=False, master_listen_fd=listening.detach(),  # the store owns it from here
            )
        self._store = store
        self._prefixed: dist.Store | None = None
        self.port: int = store.port if store is not None and hasattr(store, "port") else port
        self._token = token

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port} (job {self.job_id!r})"

    @property
    def _root(self) -> dist.Store:
        """The whole store (not namespaced), connected on first use."""
        return self._connect(None)

    @property
    def store(self) -> dist.Store:
        """The job's namespace of the store, connected on first use."""
        if self._prefixed is None:
            import torch.distributed as dist

            self._prefixed = dist.PrefixStore(f"p2psync/{self.job_id}/", self._connect(None))
        return self._prefixed

    def _connect(self, key: str | None, timeout: float | None = None, deadline: float | None = None) -> dist.Store:
        """The store client, connecting it first if need be: within `timeout` (default the
        rendezvous's), or by `deadline` when a caller's wait for `key` shares it."""
        if self._store is not None:
            return self._store
        import torch.distributed as dist

        timeout = self.timeout if timeout is None else timeout
        if deadline is None:
            deadline = math.inf if self.patient else time.monotonic() + timeout
        awaited = f", waiting for key {key!r}" if key else ""
        failure = _wait_listening(self.host, self.port, deadline, self.where)
        if failure:
            raise RendezvousError(f"no rendezvous answers at {self.where} within {timeout:g} s{awaited}: {failure}")
        try:
            self._store = dist.TCPStore(
                self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout), wait_for_workers=False
            )
        except Exception as exc:  # DistNetworkError: it listened a moment ago
            raise RendezvousError(
                f"rendezvous at {self.where} refused this client{awaited}: {first_line(exc)}"
            ) from exc
        return self._store

    def reset(self) -> None:
        """Drop the store client (its store went away): the next call connects anew."""
        if self._store is not None and not hasattr(self._store, "port"):
            return  # a store handed in, not a client of host:port
        self._store = self._prefixed = None

    def held(self, engine_id: str, rank: int, timeout: float) -> TargetTable | None:
        """The table holding engine `engine_id` rank `rank`'s place now (None: free), asking for
        at most `timeout` seconds; RendezvousError where the store does not answer."""
        key = f"engine/{engine_id}/rank/{rank}"
        self._connect(key, timeout, time.monotonic() + timeout)
        try:
            value = self.store.get(key) if self.store.check([key]) else b""
        except Exception as exc:  # the store went away
            raise RendezvousError(f"rendezvous {self.where} failed reading key {key!r}: {first_line(exc)}") from exc
        return TargetTable.from_json(value) if value else None

    def clone(self) -> Rendezvous:
        """Another client of the same store and job, for another thread to use."""
        root = self._connect(None)
        store = root.clone() if hasattr(root, "clone") else root
        return Rendezvous(
            host=self.host, port=self.port, job_id=self.job_id, timeout=self.timeout, store=store, token=self._token
        )

    def token(self) -> str:
        """The job's secret token: as given, else the job's (`core.token.job_token`)."""
        if self._token is None:
            self._token = job_token(self.job_id)
        return self._token

    def publish(self, table: TargetTable, *, replacing: TargetTable | None = None) -> TargetTable | None:
        """Publish one engine rank's table if its place is free (never published, or
        withdrawn), or holds exactly `replacing`. Returns None when published, else the
        table that holds the place (nothing is published then)."""
        key = f"engine/{table.engine_id}/rank/{table.rank}"
        text = table.to_json()
        expected = "" if replacing is None else replacing.to_json()
        self._connect(key)
        held = self.store.compare_set(key, expected, text)
        if held != text.encode():
            return TargetTable.from_json(held)
        self.store.set(f"engine/{table.engine_id}/world_size", str(table.world_size))
        if self.store.add(f"engine/{table.engine_id}/listed", 1) == 1:  # the job's first table of this engine
            self.store.set(f"engines/{self.store.add('engines/count', 1) - 1}", table.engine_id)
        log.info(
            "published target table of %s rank %d (incarnation %d, %d parameters)",
            table.engine_id, table.rank, table.incarnation, len(table.params),
        )
        return None

    def unpublish(self, table: TargetTable) -> None:
        """Withdraw one engine rank's table (on a clean shutdown), so that trainers
        connecting later wait for its successor instead of reaching a dead rank. A
        table that a successor replaced stays."""
        self.store.compare_set(f"engine/{table.engine_id}/rank/{table.rank}", table.to_json(), "")

    def engine_ids(self) -> list[str]:
        """Every engine id ever published in the job, in the order first published (withdrawn
        ones too: `read_engine` tells)."""
        self._connect("engines/count")
        if not self.store.check(["engines/count"]):
            return []
        count = int(self.store.get("engines/count"))
        return [self._get(f"engines/{i}", None, self.timeout).decode() for i in range(count)]

    def read_engine(self, engine_id: str, timeout: float | None = None) -> list[TargetTable]:
        """Every rank's table of one engine, waiting up to `timeout` for them all to appear."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        prefix = f"engine/{engine_id}"
        world_size = int(self._get(f"{prefix}/world_size", engine_id, timeout, deadline))
        tables = []
        for rank in range(world_size):
            table = TargetTable.from_json(self._get(f"{prefix}/rank/{rank}", engine_id, timeout, deadline))
            if (table.engine_id, table.rank, table.world_size) != (engine_id, rank, world_size):
                raise RendezvousError(
                    f"rendezvous key of engine {engine_id!r} rank {rank} holds the table of engine "
                    f"{table.engine_id!r} rank {table.rank} of {table.world_size}"
                )
            tables.append(table)
        return tables

    def set(self, key: str, value: str | bytes) -> None:
        self._connect(key)
        self.store.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; Store.set takes bytes too

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._get(key, None, self.timeout if timeout is None else timeout)

    def add(self, key: str, amount: int = 1) -> int:
        """Add `amount` to the job's counter `key` (0 while unset) and return the sum: one
        atomic step of the store, so processes of the job number their turns without a lock."""
        self._connect(key)
        return self.store.add(key, amount)

    def group_store(self, prefix: str) -> dist.Store:
        """The job's keys under `prefix`, as a store of their own: where a torch.distributed
        process group (`init_process_group(store=...)`) meets through this rendezvous, with no
        second port and no key shared with the job's others (or another group's)."""
        import torch.distributed as dist

        self._connect(prefix)
        return dist.PrefixStore(prefix, self.store)

    def _get(self, key: str, engine_id: str | None, timeout: float, deadline: float | None = None) -> bytes:
        """The value of `key` once it is set (and not withdrawn), polling until `deadline`
        (default: `timeout` from now; a wait for several keys shares one deadline)."""
        deadline = time.monotonic() + timeout if deadline is None else deadline
        self._connect(key, timeout, deadline)
        who = f" of engine {engine_id!r}" if engine_id else ""
        pause = POLL[0]
        try:
            while True:
                if self.store.check([key]):
                    value = self.store.get(key)
                    if value:
                        return value
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(pause, left))
                pause = min(pause * 2, POLL[1])
        except Exception as exc:  # the store went away
            raise RendezvousError(
                f"rendezvous {self.where} failed while waiting for key {key!r}{who}: {first_line(exc)}"
            ) from exc
        raise RendezvousError(f"rendezvous {self.where}: key {key!r}{who} not published within {timeout:g} s")


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` and listening, for a server that must be reached at
    `host` only: torch's TCPStore, left to bind itself, listens on every interface (`[::]`),
    so that whoever reaches any address of this machine reaches the store. Handed to it as
    `master_listen_fd`. RendezvousError where `host` is not an address of this machine or
    the port is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise RendezvousError(f"cannot serve a rendezvous at {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted trainer takes its port again
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RendezvousError(
            f"cannot serve a rendezvous at {host}:{port}: {exc} (the rendezvous listens on the address its "
            "peers use; it must be one of this machine's)"
        ) from exc
    return sock


def _wait_listening(host: str, port: int, deadline: float, where: str) -> str:
    """Wait until something accepts TCP connections at host:port; "" then, else why not.
    A long wait says so at INFO, at growing intervals."""
    pause = POLL[0]
    start = time.monotonic()
    report = SAY_WAITING
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return ""
        except ConnectionRefusedError:
            failure = "connection refused"
        except OSError as exc:
            failure = str(exc) or type(exc).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            return failure
        waited = time.monotonic() - start
        if waited >= report:
            log.info("waiting for the rendezvous at %s (%.0f s so far: %s)", where, waited, failure)
            report = min(report * 2, waited + SAY_WAITING_MAX)
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL[1])
