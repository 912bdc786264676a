"""verl checkpoint-engine backend "p2psync".

Setup (verl 0.9.x, hydra overrides):

    actor_rollout_ref.rollout.checkpoint_engine.backend=p2psync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=p2psync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.p2psync.rendezvous=ray
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.p2psync.engine_id='rollout-{replica}'

verl imports `custom_backend_module` in every actor and rollout worker before it
builds the engine; importing this module registers the backend (verl has no
entry-point group for checkpoint engines). `rendezvous` is "ray" (the job's rendezvous
actor, found by name by every actor: `p2psync.adapters.ray`) or "HOST:PORT" (a store the
actor rank 0 hosts unless `host_rendezvous` is false, or `p2psync rendezvous`). Other
engine_kwargs: `job_id`, `engine_id`, `transport` (default "mooncake"), `transfer_timeout`,
`check`, `host_rendezvous`.

Trainer side (verl builds it with `is_master=`): a p2psync Session over the
per-tensor generator verl hands to `send_weights` (`IterableSource`). Every actor
rank runs the generator to its end (its gathers are collectives) while the engines still
serve, keeping only its own rows of each tensor on the host (1/W of the model on each of
W ranks, the metric `p2psync/stream_held_bytes`); then each rank writes its rows straight
into the engine ranks' parameter memory, with no further gather. verl hands the backend
gathered tensors only (its shard export goes to its own delta backend alone), so the
stream's gathers stay verl's.

Rollout side (verl builds it without `is_master`): the engine's parameters are
already exposed by a p2psync engine endpoint (the torch, vLLM or sglang adapter)
in the process that holds them. `receive_weights` waits until the trainer reports
this engine's update (named by a token `build_topology` gives both sides of each update,
so that a restarted worker never takes an earlier update's report for this one's), raises
if the engine was left stale, and then yields nothing:
the bytes are already in place, so verl's server adapter receives an empty stream
and loads nothing tensor by tensor (verl 0.9.1's sglang adapter then still flushes
its cache and records global_steps; its vLLM adapter was not checked). That is the one difference from
verl's contract, where receive_weights yields every (name, tensor).

Which engine a rollout worker stands for: the endpoint `attach()`ed in its process
(an engine served in the same process, e.g. `p2psync.adapters.torch.serve`), else
`engine_id` filled in from the worker's place in the job (`p2psync.core.identity`: verl's
rollout workers are `rollout_standalone_<replica>...` actors and its sglang servers
`sglang_server_<replica>_<node>`, so "rollout-{replica}" names one replica alike on both,
with no code), else `$P2PSYNC_ENGINE_ID`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import AsyncGenerator, Generator
from typing import TYPE_CHECKING, Any

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .iterable import IterableSource

if TYPE_CHECKING:
    import torch

    from ..engine.endpoint import EngineEndpoint
    from ..core.rendezvous import Rendezvous
    from ..trainer.session import Session

log = logging.getLogger(__name__)

BACKEND = "p2psync"
#: The version label of an update verl gives no step number: `update-N`.
STEP_PREFIX = "update-"
_attached: list[EngineEndpoint] = []


def attach(endpoint: EngineEndpoint) -> None:
    """Name the engine endpoint serving this process's rollout weights (rollout side)."""
    _attached[:] = [endpoint]


def _done_key(engine_id: str, update: str) -> str:
    return f"verl/done/{engine_id}/{update}"


@CheckpointEngineRegistry.register(BACKEND)
class P2PSyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine that syncs through a p2psync Session.

    `is_master` is given by verl on actor workers only; its absence marks a
    rollout worker. `bucket_size` (verl's update_weights_bucket_megabytes) is the
    Session's bucket_bytes.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int,
        is_master: bool | None = None,
        *,
        rendezvous: str,
        job_id: str = "verl",
        engine_id: str | None = None,
        transport: str = "mooncake",
        transport_options: dict[str, Any] | None = None,
        transfer_timeout: float = 600.0,
        check: bool = False,
        host_rendezvous: bool = True,
        rendezvous_timeout: float = 600.0,
    ) -> None:
        self.role = "rollout" if is_master is None else "actor"
        self.is_master = bool(is_master)
        self.bucket_size = int(bucket_size)
        self.address = rendezvous
        self.job_id = job_id
        self.engine_id_template = engine_id
        self.transport = transport
        self.transport_options = transport_options
        self.transfer_timeout = transfer_timeout
        self.check = check
        self.host_rendezvous = host_rendezvous
        self.rendezvous_timeout = rendezvous_timeout
        self._rdzv: Rendezvous | None = None
        self._session: Session | None = None
        self._source: IterableSource | None = None
        self._engines: list[str] = []
        self._connected: list[str] | None = None
        self._steps = 0
        self._update: str | None = None  # this update's token, from build_topology
        self.engine_id: str | None = None

    # -- verl's protocol ---------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if self.role == "actor":
            from ..trainer import collectives

            return {"role": "actor", "rank": collectives.world_rank()}
        return {"role": "rollout", "engine_id": self._own_engine_id()}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if [m.get("role") for m in actors] != ["actor"] * actor_wg_world_size or [
            m.get("role") for m in rollouts
        ] != ["rollout"] * rollout_world_size:
            raise ValueError(f"p2psync: expected {actor_wg_world_size} actor then {rollout_world_size} rollout metadata")
        engines = list(dict.fromkeys(m["engine_id"] for m in rollouts))
        update = secrets.token_hex(8)  # verl builds the topology once per update
        return (
            {"engines": [engines] * actor_wg_world_size, "update": [update] * actor_wg_world_size},
            {"engine_id": [m["engine_id"] for m in rollouts], "update": [update] * rollout_world_size},
        )

    def init_process_group(
        self, engines: list[str] | None = None, engine_id: str | None = None, update: str | None = None, **_: Any
    ) -> None:
        """`update`: the token both sides name this update's report by (without it, the version label)."""
        self._update = update
        rendezvous = self._rendezvous()
        if self.role == "actor":
            self._engines = list(engines or [])
            if self._session is None:
                from ..trainer.options import SessionOptions
                from ..trainer.session import Session

                self._source = IterableSource()
                options = SessionOptions(  # verl's checkpoint-engine settings, as p2psync's options
                    bucket_bytes=self.bucket_size, transfer_timeout=self.transfer_timeout, check=self.check,
                    transport_options=self.transport_options,
                )
                self._session = Session(
                    source=self._source, transport=self.transport, rendezvous=rendezvous, options=options
                )
        else:
            self.engine_id = engine_id or self._own_engine_id()

    def finalize(self) -> None:
        """Nothing per step: the session, its registered buffers and peers live on to the next update."""

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        assert self._session is not None and self._source is not None, "send_weights before init_process_group"
        source, session = self._source, self._session
        try:
            source.take(weights)  # every rank runs verl's gathers to the end, keeping its own rows (1/W of the model)
            held = source.held_bytes
            if self._connected != self._engines:
                session.connect(self._engines)
                self._connected = list(self._engines)
                if global_steps is None:  # a label an engine served names those weights alone: count on
                    self._steps = max(self._steps, session.served_count(STEP_PREFIX))
            version = self._version(global_steps)
            report = session.update(version)
        finally:
            source.release()
        if self.is_master:
            for name, engine in report.engines.items():
                outcome = {"ok": engine.ok, "error": engine.error, "version": version}
                self._rendezvous().set(_done_key(name, self._update or version), json.dumps(outcome))
        if not report.ok:
            raise RuntimeError(f"p2psync update {version} left engines stale: {report.format()}")
        return report.metrics() | {"p2psync/stream_held_bytes": float(held)}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Wait for the trainer's report on this engine; yield nothing (the bytes are in place)."""
        update = self._update or self._version(global_steps)
        engine_id = self.engine_id or self._own_engine_id()
        rdzv = self._rendezvous()
        outcome = json.loads(await asyncio.to_thread(rdzv.get, _done_key(engine_id, update), self.rendezvous_timeout))
        if not outcome["ok"]:
            raise RuntimeError(f"p2psync: engine {engine_id!r} did not get weights {outcome['version']}: "
                               f"{outcome['error']}")
        log.info("engine %s: weights %s written in place by the trainer", engine_id, outcome["version"])
        return
        yield  # an async generator, as verl expects

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    # -- helpers -----------------------------------------------------------------------

    def _version(self, global_steps: int | None) -> str:
        if global_steps is None:
            self._steps += 1
            return f"{STEP_PREFIX}{self._steps}"
        return str(global_steps)

    def _rendezvous(self) -> Rendezvous:
        if self._rdzv is None:
            from ..adapters.ray import rendezvous_at

            self._rdzv = rendezvous_at(
                self.address, job_id=self.job_id, timeout=self.rendezvous_timeout,
                host_it=self.role == "actor" and self.is_master and self.host_rendezvous,
            )
        return self._rdzv

    def _own_engine_id(self) -> str:
        if _attached:
            return _attached[0].engine_id
        if self.engine_id_template:
            from ..core.identity import expand_engine_id

            return expand_engine_id(self.engine_id_template)
        engine_id = os.environ.get("P2PSYNC_ENGINE_ID")
        if not engine_id:
            raise RuntimeError(
                "p2psync: this rollout worker serves no engine: set engine_kwargs.p2psync.engine_id (a template such "
                "as 'rollout-{replica}'), call p2psync.integrations.verl.attach(endpoint) in the process that serves "
                "it, or set P2PSYNC_ENGINE_ID"
            )
        return engine_id
