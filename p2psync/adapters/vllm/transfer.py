"""p2psync as a vLLM weight-transfer backend named "p2psync".

A vLLM user selects it with `WeightTransferConfig(backend="p2psync")` and drives
it through vLLM's own init / start / update / finish flow:

- worker side (`P2PSyncWeightTransferEngine`, one per worker): `init_transfer_engine`
  registers the rank's live parameters with the transport and publishes its
  target table at the rendezvous; the trainer then writes each rank's own bytes
  straight into them, so `update_weights` has nothing to receive;
  `finish_weight_update` runs vLLM's post-load step.
- trainer side (`P2PSyncTrainerWeightTransferEngine`, on every trainer rank):
  wraps a p2psync `Session`; `send_weights` is one collective `Session.update`
  between the start and finish calls that trainer rank 0 makes through the clients.

Imported only by vLLM's factories (registered in `vllm_plugin`), so it may import vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...engine.endpoint import EngineEndpoint
from ...core.rendezvous import Rendezvous
from ...core.report import UpdateReport
from ...trainer.options import SessionOptions
from ...trainer.session import Session
from ...core.source import TrainerSource
from . import shim
from .endpoint import serve

BACKEND = "p2psync"


@dataclass
class P2PSyncInitInfo(WeightTransferInitInfo):
    """What a worker needs to join a p2psync job (sent by the trainer at init)."""

    engine_id: str
    rendezvous_host: str
    rendezvous_port: int
    job_id: str
    transport: str = "mooncake"
    transport_options: dict[str, Any] = field(default_factory=dict)
    token: str = ""
    #: Address the worker's control endpoint listens on (reachable by trainer rank 0).
    host: str = "127.0.0.1"
    #: The vLLM API server's address ("http://host:port"), where the trainer pauses and resumes it
    #: for each update in the session's pause mode; "" where the caller pauses the server itself.
    server_url: str = ""


@dataclass
class P2PSyncUpdateInfo(WeightTransferUpdateInfo):
    """The bytes have landed before this is sent; it only names the version."""

    version: str = ""


class P2PSyncWeightTransferEngine(WeightTransferEngine[P2PSyncInitInfo, P2PSyncUpdateInfo]):
    """Worker side: exposes this rank's parameters; receives nothing itself (writes are one-sided)."""

    init_info_cls = P2PSyncInitInfo
    update_info_cls = P2PSyncUpdateInfo
    supports_draft_weight_update = False  # the published table is the target model's

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint: EngineEndpoint | None = None
        self.version: str | None = None

    def init_transfer_engine(self, init_info: P2PSyncInitInfo) -> None:
        if self.endpoint is not None:
            raise RuntimeError("p2psync weight transfer is already initialized; shut it down first")
        rendezvous = Rendezvous(host=init_info.rendezvous_host, port=init_info.rendezvous_port, job_id=init_info.job_id)
        self.endpoint = serve(
            self.model, self.vllm_config, rank=shim.tp_rank(), engine_id=init_info.engine_id,
            rendezvous=rendezvous, transport=init_info.transport, host=init_info.host, token=init_info.token,
            transport_options=init_info.transport_options,
            extra={"server_url": init_info.server_url} if init_info.server_url else None,
        )

    def start_weight_update(self) -> None:
        """Nothing to prepare: trainers write into the live parameters."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator stream; one-sided writes used none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: P2PSyncUpdateInfo) -> None:
        self.version = update_info.version

    def finish_weight_update(self) -> None:
        if self.device.type != "cpu":
            # On CPU vLLM's post-load step repacks linear weights away from the published
            # addresses (and the PyPI wheel has no CPU kernels to serve with anyway).
            shim.post_process(self.model, self.vllm_config, self.device)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


@dataclass
class P2PSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the engines to update and how to reach them."""

    backend: ClassVar[str] = BACKEND

    engine_ids: list[str]
    rendezvous_host: str
    rendezvous_port: int
    job_id: str
    transport: str = "mooncake"
    transport_options: dict[str, Any] = field(default_factory=dict)
    token: str = ""
    #: Where each engine's workers listen for control calls.
    worker_host: str = "127.0.0.1"
    #: Per engine id, its vLLM API server's address: the session pauses and resumes that server
    #: itself, in its pause mode (engines not named are paused by the caller, as vLLM's flow does).
    server_urls: dict[str, str] = field(default_factory=dict)
    #: How the trainer's session moves weights: a SessionOptions, or its fields as a mapping where the
    #: init info is built from plain data (its token and transport options are the ones above).
    options: SessionOptions | Mapping[str, Any] = field(default_factory=SessionOptions)


class EngineClients:
    """One `VLLMWeightSyncClient` per engine, driven as one; each engine's init info gets
    its own `engine_id`."""

    def __init__(self, clients: Mapping[str, VLLMWeightSyncClient]) -> None:
        self.clients = dict(clients)

    def init_weight_transfer_engine(self, init_info: dict[str, Any], server_urls: Mapping[str, str]) -> None:
        for engine_id, client in self.clients.items():
            client.init_weight_transfer_engine(
                {**init_info, "engine_id": engine_id, "server_url": server_urls.get(engine_id, "")}
            )

    def start_weight_update(self) -> None:
        for client in self.clients.values():
            client.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        for client in self.clients.values():
            client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        for client in self.clients.values():
            client.finish_weight_update(weight_version)


class P2PSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[P2PSyncTrainerInitInfo]):
    """Trainer side: a p2psync Session over `source` (a p2psync `TrainerSource`, e.g. FSDP2Source).
    Every trainer rank sends its share; rank 0 drives the clients."""

    init_info_cls = P2PSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: TrainerSource, rank: int, session: Session) -> None:
        super().__init__(client=client, source=None, is_sender=rank == 0, rank=rank)
        self.trainer_source = source
        self.session = session
        self.report: UpdateReport | None = None
        self._versions = itertools.count(1)

    @classmethod
    def trainer_init(
        cls, init_info: P2PSyncTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Any = None
    ) -> P2PSyncTrainerWeightTransferEngine:
        if not isinstance(source, TrainerSource):
            raise TypeError(
                f"the p2psync backend needs a p2psync TrainerSource (e.g. FSDP2Source), got {type(source).__name__}"
            )
        if not isinstance(client, EngineClients):
            if len(init_info.engine_ids) != 1:
                raise ValueError("several engines need one client each: pass EngineClients({engine_id: client})")
            client = EngineClients({init_info.engine_ids[0]: client})
        if init_info.is_sender:
            client.init_weight_transfer_engine(
                {
                    "rendezvous_host": init_info.rendezvous_host, "rendezvous_port": init_info.rendezvous_port,
                    "job_id": init_info.job_id, "transport": init_info.transport,
                    "transport_options": init_info.transport_options, "token": init_info.token,
                    "host": init_info.worker_host,
                },
                init_info.server_urls,
            )
        rendezvous = Rendezvous(host=init_info.rendezvous_host, port=init_info.rendezvous_port, job_id=init_info.job_id)
        session = Session(
            source=source, transport=init_info.transport, rendezvous=rendezvous, options=init_info.options,
            transport_options=init_info.transport_options, token=init_info.token,
        )
        session.connect(init_info.engine_ids)
        return cls(client=client, source=source, rank=init_info.rank, session=session)

    def send_weights(self, version: str | None = None) -> None:
        """One update of every engine; the report (stale engines named) is kept in `self.report`.
        Collective over the trainer ranks."""
        version = version or f"p2psync-{next(self._versions)}"
        if self.is_sender:
            self.client.start_weight_update()
        assert isinstance(self.client, EngineClients)
        self.report = self.session.update(version)
        if self.is_sender:
            for engine_id, client in self.client.clients.items():
                if self.report.engines[engine_id].ok:  # a stale engine keeps its old version
                    client.update_weights({"version": version})
                    client.finish_weight_update(weight_version=version)

    def shutdown(self) -> None:
        self.session.close()
