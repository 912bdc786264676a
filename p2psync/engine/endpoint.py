"""The engine-side endpoint (its trainer-side client is `client.EndpointControl`).

An endpoint runs inside an engine worker (one per rank): it registers exactly
the rank's parameter memory (and a patch area for delta updates) with the transport,
claims the engine id and publishes the target table, and serves the control calls
`pause` (fencing off the writes of an update that never finished first: they may still be
on their way), `renew`, `patch` (apply a delta patch, see `patch.PatchArea`), `finish`,
`digest`, `info` (its status), `label` (whether it takes a version label: see
`fingerprints.HeldWeights`) and `retire`. Adapters whose engine has no control API of its own
(a plain torch module, a worker without a server) use it as is; the callables say
what pausing and resuming mean for that engine. Whether the engine may serve, and
the lease of an update in progress, live in its `EngineState`.

The memory is open to remote writes only while an update holds the engine paused: from its
`pause` to its `finish`, `fail` or lease's end (and at `retire`) the endpoint has the
transport `conceal` it, so that a process without the job's token, which the control routes
refuse (403), cannot change what the engine serves nor read its weights through the
transport's port either (`Transport.conceal`). Where a transport cannot conceal (NIXL, the
same-host transport, torch.distributed, Mooncake over RDMA), the endpoint says so at start and
verifies its weights while it serves instead (`verify_seconds`): bytes changed outside an
update take it out of serving, stale, until a later update finishes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..core.control import ControlServer, Refused
from ..core.digest import byte_view, digest
from ..core.host import local_host, node_id
from ..core.identity import expand_engine_id
from ..core.logs import identify
from ..core.errors import P2PSyncError, where
from ..core.exits import CloseAtExit
from ..core.memory import device_of
from ..core.pause import PAUSE_MODES, PauseMode, pause_mode
from ..core.types import TargetParam, TargetTable
from .claim import claim
from .client import PAUSE_MODES_KEY, EndpointControl
from .fingerprints import HeldWeights
from .hooks import EndpointOptions, EngineHooks
from .metrics import CONTENT_TYPE, exposition
from .patch import PatchArea, default_area_bytes
from .presence import Presence
from .state import EngineState

if TYPE_CHECKING:
    import torch

    from ..core.rendezvous import Rendezvous
    from ..core.transport import Transport

#: Where engine adapters, tools and users import them from.
__all__ = ["EndpointControl", "EndpointOptions", "EngineEndpoint", "EngineHooks", "offline_table"]

log = logging.getLogger(__name__)

#: Seconds between checks of a serving engine's weights where its transport cannot conceal them.
VERIFY_SECONDS = 10.0


class EngineEndpoint:
    """Exposes one engine rank's parameters to trainers.

    `engine_id` may be a template filled in from the process's place in the job
    (`rollout-{replica}`: see `core.identity`). `version` declares the version of the
    weights the engine loaded; without it the engine holds weights of no known version
    and stays out of serving until its first update lands. `incarnation` replaces a live predecessor of the same engine id and
    rank explicitly (it must be higher than the predecessor's); without it the endpoint
    refuses to start beside a live one, and replaces a dead one as the next incarnation.
    `patch_bytes` sizes the patch area delta updates write into (None: an eighth of
    the parameter bytes, 1 to 64 MiB; 0: none, the rank takes full updates only).
    Delta updates patch the bytes the last update left; an engine whose post-load
    step rewrites its published parameters in place must pass 0.
    `verify_seconds`: where the transport cannot conceal the memory between updates, how often
    a serving rank compares its weights with the fingerprints taken when its last update
    finished (None: every `VERIFY_SECONDS`; 0: never); any change the engine did not make
    itself (`weights_written`) takes it out of serving until the next update finishes. The
    fingerprints read every byte (on the parameters' device): 37 GB/s on one CPU core here.
    """

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
        host: str | None = None,
        token: str | None = None,
        extra: Mapping[str, Any] | None = None,
        version: str | None = None,
        incarnation: int | None = None,
        patch_bytes: int | None = None,
        verify_seconds: float | None = None,
    ) -> None:
        engine_id = expand_engine_id(engine_id)  # a template ("rollout-{replica}"): see core.identity
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
        if not self.hooks.pause_modes or not set(self.hooks.pause_modes) <= set(PAUSE_MODES):
            raise ValueError(f"{where(engine_id, rank)}: hooks.pause_modes {self.hooks.pause_modes!r} must name "
                             "one or more pause modes (p2psync.core.pause.PAUSE_MODES)")
        self.host = host or local_host(toward=rendezvous.host)
        self.token = rendezvous.token() if token is None else token
        self.extra = {**(extra or {}), PAUSE_MODES_KEY: list(self.hooks.pause_modes)}
        self.requested_incarnation = incarnation
        self.state = EngineState(version=version)
        self.table: TargetTable | None = None
        self.transport_info: dict[str, Any] = {}
        if patch_bytes is None:
            patch_bytes = default_area_bytes(sum(t.numel() * t.element_size() for t in self.params.values()))
        self.patch_bytes = patch_bytes
        self.patches: PatchArea | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = False
        self._in_flight = 0  # calls of the hooks' routes running now
        self._aborts = 0  # pauses in mode "abort": a route call that saw one answers 503 with the reason
        self._abort_reason = ""
        self._flush_at_finish = True  # as the update in progress asked at its pause
        self._watch: threading.Thread | None = None
        self._presence: Presence | None = None  # keeps the table published while rendezvous stores come and go
        self._server: ControlServer | None = None
        self._concealed = False  # the transport refuses remote access to the memory now
        self.verify_seconds = VERIFY_SECONDS if verify_seconds is None else verify_seconds
        self._verify: threading.Thread | None = None
        self._updates = 0  # pauses and finishes so far: a weights check that saw one is void
        self.held = HeldWeights(self.params, version)
        self._at_exit = CloseAtExit(self)

    @classmethod
    def serve(
        cls, *, transport: Transport | str, transport_options: Mapping[str, Any] | None = None, **fields: Any
    ) -> EngineEndpoint:
        """Create an endpoint over `transport` (an instance, or a registered name built with
        `transport_options`) and start it: what every engine adapter's `serve` does."""
        from ..core.plugins import registry

        transport = registry().make_transport(transport, transport_options)
        endpoint = cls(transport=transport, **fields)
        endpoint.start()
        return endpoint

    @property
    def url(self) -> str:
        """Where the control calls (and the hooks' extra routes) are served."""
        assert self._server is not None, "start() first"
        return self._server.url

    @property
    def where(self) -> str:
        return where(self.engine_id, self.rank)

    @property
    def version(self) -> str | None:
        """The version of the weights this rank holds (None while unknown)."""
        with self._lock:
            return self.state.version

    def start(self) -> TargetTable:
        """Take the engine out of serving unless its version is known, register the
        parameter memory, start serving control calls, claim the engine id and publish
        the table. Raises RendezvousError, having released everything, if a live engine
        holds the id."""
        identify(job=self.rendezvous.job_id, side=f"engine {self.engine_id}", rank=self.rank)
        if not self.state.serving:
            self.hooks.pause("abort")  # nothing is in flight yet
        self.transport.bind(self.rendezvous)
        # Zero-element parameters have no memory to register (a transport may refuse
        # size 0); their tables still list them, and no write ever reaches them.
        if self.patch_bytes and self.params:
            self.patches = PatchArea(self.patch_bytes, device_of(list(self.params.values())))
        self.transport_info = self.transport.expose(self._exposed())
        self._conceal()
        if not self._concealed:
            verified = (f"weights changed outside an update are caught within {self.verify_seconds:g} s" if
                        self.verify_seconds > 0 else "nothing verifies the weights between updates (verify_seconds=0)")
            log.warning("%s: transport %r cannot conceal the engine's memory between updates: whoever reaches its "
                        "port may write and read it, job token or not (see the transport's docs); %s", self.where,
                        self.transport.name, verified)
        routes = {
            "pause": self._pause, "renew": self._renew, "patch": self._patch, "finish": self._finish,
            "digest": self._digest, "info": self._info, "retire": self._retire, "held": self._held,
            "fail": self._fail, "label": self._label,
        }
        routes.update({name: self._serving_only(handler) for name, handler in self.hooks.routes.items()})
        self._server = ControlServer(routes, host=self.host, token=self.token,
                                     pages={"metrics": (CONTENT_TYPE, self._metrics)})
        try:
            self.table = claim(
                self.rendezvous, self._table(), incarnation=self.requested_incarnation, token=self.token,
                publishing=self._publishing,
            )
        except BaseException:
            self.table = None
            self._server.close()
            self._server = None
            self.transport.close()
            raise
        self._watch = threading.Thread(target=self._watch_lease, name=f"p2psync-lease-{self.engine_id}", daemon=True)
        self._watch.start()
        self._presence = Presence(self.rendezvous, lambda: self.table)
        self._presence.start()
        if not self._concealed and self.verify_seconds > 0:
            self._verify = threading.Thread(
                target=self._verify_weights, name=f"p2psync-verify-{self.engine_id}", daemon=True
            )
            self._verify.start()
        return self.table

    def _publishing(self, table: TargetTable) -> None:
        """The table this endpoint is about to publish: its info route answers as it at once."""
        self.table = table

    def _exposed(self) -> list[torch.Tensor]:
        """The memory trainers write: every parameter with elements, and the patch area."""
        return [t for t in self.params.values() if t.numel() > 0] + ([self.patches.tensor] if self.patches else [])

    def _conceal(self) -> None:
        """Refuse remote access to the memory until the next pause, where the transport can
        (lock held, or before the endpoint serves)."""
        if not self._concealed:
            self._concealed = self.transport.conceal(self._exposed())

    def _reveal(self, unfinished: str | None) -> None:
        """At a pause: open the memory to the update's writes (lock held). After `unfinished`,
        an update that never finished here, first keep its writes, which may still be on their
        way, from landing from now on (the transport drops every connection and exposes the
        memory anew). New transport info is published."""
        info = self.transport.fence(self._exposed()) if unfinished is not None else None
        if unfinished is not None and info is None:
            log.warning("%s: update %r never finished and transport %r cannot fence off its writes; a late one "
                        "is caught only by a digest check (check=True)", self.where, unfinished, self.transport.name)
        if info is None and self._concealed:
            info = self.transport.expose(self._exposed())
        self._concealed = False
        if info is None or info == self.transport_info:
            return
        self.transport_info = info
        if self.table is not None:
            moved = dataclasses.replace(self.table, transport_info=info)
            held = self.rendezvous.publish(moved, replacing=self.table)
            if held is None:
                self.table = moved
            else:
                log.warning("%s: the new transport info was not published: %s holds its place", self.where, held.instance)
        if unfinished is not None:
            log.info("%s: fenced off the writes of unfinished update %r; now at %s", self.where, unfinished, info)

    def _table(self) -> TargetTable:
        return TargetTable(
            engine_id=self.engine_id,
            rank=self.rank,
            world_size=self.world_size,
            engine=self.engine,
            layout_key=self.layout_key,
            transport=self.transport.name,
            transport_info=self.transport_info,
            control_url=self.url,
            params=published_params(self.params),
            job_id=self.rendezvous.job_id,
            extra=self.extra,
            incarnation=self.requested_incarnation or 0,
            instance=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            node=node_id(),
            patch_area=(self.patches.tensor.data_ptr(), self.patches.nbytes) if self.patches else None,
        )

    def weights_written(self, what: str) -> None:
        """Tell the endpoint that something outside p2psync wrote its weights (`what`: a load
        route, a hook): the next delta update sends this rank its full bytes."""
        self.held.written(what)

    # -- life -----------------------------------------------------------------------------

    def close(self) -> None:
        """Withdraw the table (unless a successor replaced it), stop serving control calls,
        unregister the memory (at interpreter exit, if not called before)."""
        self._at_exit.cancel()
        if self._presence is not None:
            self._presence.stop()
            self._presence = None
        if self.table is not None:
            try:
                self.rendezvous.unpublish(self.table)
            except P2PSyncError as exc:  # the rendezvous host may be gone first
                log.info("%s: table not withdrawn: %s", self.where, exc)
            self.table = None
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        for thread in (self._watch, self._verify):
            if thread is not None:
                thread.join()
        self._watch = self._verify = None
        if self._server is not None:
            self._server.close()
            self._server = None
        self.transport.close()

    def _watch_lease(self) -> None:
        """Mark an update abandoned when its lease runs out (see EngineState)."""
        while True:
            with self._lock:
                while not self._closing and self.state.lease_until is None:
                    self._changed.wait()
                until = self.state.lease_until
                if self._closing or until is None:
                    return
                self._changed.wait(max(0.0, until - time.monotonic()))
                reason = self.state.expire(time.monotonic())
                if reason:
                    self._conceal()
            if reason:
                log.error("%s: %s; not serving until an update finishes", self.where, reason)
                self.hooks.on_stale(reason)

    def _verify_weights(self) -> None:
        """Where the transport cannot conceal the memory: every `verify_seconds` while the rank
        serves, compare its weights with the fingerprints of its last update; bytes changed
        outside an update (a write it could not refuse) take it out of serving, stale, until a
        later update finishes. A check that saw an update begin or end is void."""
        while True:
            with self._lock:
                deadline = time.monotonic() + self.verify_seconds
                while not self._closing and (left := deadline - time.monotonic()) > 0:
                    self._changed.wait(left)
                if self._closing:
                    return
                if not self.state.serving:
                    continue
                updates = self._updates
            changed = self.held.changed_unseen()
            if changed is None:
                continue
            with self._lock:
                if self._closing or self._updates != updates or not self.state.serving:
                    continue
                reason = f"its weights changed outside an update: {changed}"
                self.state.altered(reason)
                self._changed.notify_all()
                self._stop_serving("abort", drain_seconds=0.0)
            log.error("%s: %s; not serving until an update finishes", self.where, reason)
            self.hooks.on_stale(reason)

    # -- control routes -------------------------------------------------------------------

    def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        version, lease = str(body["version"]), float(body["lease"])
        mode = str(body.get("mode", "abort"))
        if mode not in self.hooks.pause_modes:
            raise Refused(f"{self.where} cannot pause in mode {mode!r}; it has {', '.join(self.hooks.pause_modes)}")
        with self._lock:
            unfinished = self.state.updating
            was_serving = self.state.begin(version, lease, time.monotonic())
            self._updates += 1
            self._flush_at_finish = bool(body.get("flush_cache", True))
            self._changed.notify_all()
            if was_serving:
                self._stop_serving(pause_mode(mode), float(body.get("drain_seconds", lease)))
            self._reveal(unfinished)
        self.held.settle()  # the last update's fingerprints are read before any write lands
        return {**self.state.status(), "transport_info": self.transport_info}

    def _stop_serving(self, mode: PauseMode, drain_seconds: float) -> None:
        """With the lock held and no new route call admitted: carry out `mode` on the calls in
        flight, then the engine's own pause. A drain longer than `drain_seconds` (the trainer's
        call would time out) refuses the pause: the engine stays out of serving, the update
        goes on without it, and its lease runs out."""
        if mode == "abort":  # the calls in flight see it as they end
            self._aborts += 1
            self._abort_reason = self.state.why_not_serving()
        elif mode == "wait":
            deadline = time.monotonic() + drain_seconds
            while self._in_flight and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            if self._in_flight:
                raise Refused(f"{self.where}: {self._in_flight} request(s) still in flight after {drain_seconds:g} s "
                              "of draining (pause mode 'wait')")
        self.hooks.pause(mode)

    def _held(self, body: dict[str, Any]) -> dict[str, Any]:
        altered = self.held.altered()
        with self._lock:
            return {"version": self.state.version, "altered": altered}

    def _renew(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.state.renew(str(body["version"]), time.monotonic())
            self._changed.notify_all()
        return {}

    def _patch(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.patches is None:
                raise Refused(f"{self.where} has no patch area (patch_bytes=0)")
            self.state.check_update(str(body["version"]), "patch")
            return {"changed": self.patches.apply(self.params, body["records"])}

    def _finish(self, body: dict[str, Any]) -> dict[str, Any]:
        version = str(body["version"])
        with self._lock:
            self.state.check_update(version, "finish")
            self._conceal()  # every write of the update landed: from here on none lands
            self.hooks.post_process()
            mislabelled = self.held.mislabelled(version)
            if mislabelled is not None:
                raise Refused(f"{self.where}: {mislabelled}")
            if self._flush_at_finish:
                self.hooks.flush_cache()
            self.state.complete(version)
            self._updates += 1
            self.held.finished(version)
            self._changed.notify_all()
            self.hooks.resume()
        log.info("%s: serving weight version %s", self.where, version)
        return {"version": version}

    def _fail(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            stale, was_serving = self.state.fail(str(body["version"]), str(body["reason"]))
            self._conceal()
            self._changed.notify_all()
            if was_serving:  # its finish landed, but the trainer never heard: undone
                self._stop_serving("abort", drain_seconds=0.0)
        log.error("%s: %s; not serving until an update finishes", self.where, stale)
        self.hooks.on_stale(stale)
        return {}

    def _label(self, body: dict[str, Any]) -> dict[str, Any]:
        refusal = self.held.label_refusal(str(body["version"]), rollback=bool(body["rollback"]))
        return {"refused": refusal and f"{self.where}: {refusal}"}

    def _retire(self, body: dict[str, Any]) -> dict[str, Any]:
        reason = f"replaced by incarnation {int(body['incarnation'])} of {self.where}"
        with self._lock:
            was_serving = self.state.retire(reason)
            self._conceal()
            self._changed.notify_all()
            if was_serving:
                self._stop_serving("abort", drain_seconds=0.0)
        log.error("%s: %s; not serving any more", self.where, reason)
        self.hooks.on_stale(reason)
        return {}

    def _digest(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, spans in body["regions"].items():
            if name not in self.params:
                raise KeyError(f"no parameter {name!r} on this rank")
            out[name] = digest(byte_view(self.params[name]), spans)
        return {"digests": out}

    def _metrics(self) -> str:
        labels = {"job": self.rendezvous.job_id, "engine": self.engine_id, "rank": str(self.rank)}
        with self._lock:
            return exposition(labels, self.state)

    def _info(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            status = self.state.status()
        table = self.table
        return {
            "rank": self.rank, "incarnation": table.incarnation if table else None,
            "instance": table.instance if table else None, "pause_modes": list(self.hooks.pause_modes), **status,
        }

    def _serving_only(self, handler: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Callable[..., Any]:
        def guarded(body: dict[str, Any]) -> dict[str, Any] | None:
            with self._lock:
                if not self.state.serving:
                    raise Refused(f"{self.where} is not serving: {self.state.why_not_serving()}", status=503)
                self._in_flight += 1
                aborts = self._aborts
            try:
                answer = handler(body)
            finally:
                with self._lock:
                    self._in_flight -= 1
                    self._changed.notify_all()
                    cut = self._abort_reason if self._aborts != aborts else None
            if cut is not None:  # computed while the weights changed: its answer is thrown away
                raise Refused(f"{self.where} aborted this request: {cut}", status=503)
            return answer

        return guarded




def published_params(params: Mapping[str, torch.Tensor]) -> tuple[TargetParam, ...]:
    """How a rank's table lists its parameters: names, shapes, dtypes, addresses and bytes."""
    return tuple(
        TargetParam(
            name=name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."), addr=t.data_ptr(),
            nbytes=t.numel() * t.element_size(),
        )
        for name, t in params.items()
    )


def offline_table(
    engine: str, engine_id: str, rank: int, world_size: int, params: Mapping[str, torch.Tensor],
    layout_key: dict[str, Any],
) -> TargetTable:
    """The table a rank holding `params` under `layout_key` publishes, made without serving it:
    no transport, no control address, addresses as the tensors have them (0 on meta). For tools
    that compile a connect's layouts with no engine running (`p2psync bench --connect`)."""
    return TargetTable(
        engine_id=engine_id, rank=rank, world_size=world_size, engine=engine, layout_key=layout_key,
        transport="none", transport_info={}, control_url="", params=published_params(params),
    )
