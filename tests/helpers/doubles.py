"""Test doubles: a trainer source of plain tensors, a transport that counts the peers it opens
(a connect refused before opening any has written nothing), and a connect meant to be refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from p2psync.core.errors import ConnectError
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer.session import Session
from p2psync.core.source import TrainerSource
from p2psync.core.types import ParamSpec, SenderGroup, TargetTable
from p2psync.transports.mooncake.transport import MooncakeTransport


class DictSource(TrainerSource):
    """Full tensors held by this rank, in a sender group of the test's choosing (default: alone)."""

    name = "test-dict"

    def __init__(self, tensors: Mapping[str, torch.Tensor], group: SenderGroup | None = None) -> None:
        self.tensors, self.group = dict(tensors), group or SenderGroup("all", (0,), 0)

    def sender_group(self) -> SenderGroup:
        return self.group

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.tensors.items()]

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}


class CountingTransport(MooncakeTransport):
    """Mooncake, recording the engine of every peer it opens."""

    def __init__(self, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options=options)
        self.opened: list[str] = []

    def open(self, table: TargetTable) -> Any:
        self.opened.append(table.engine_id)
        return super().open(table)


def refusal(tables: Sequence[TargetTable], tensors: Mapping[str, torch.Tensor]) -> tuple[str, list[str]]:
    """Publish `tables` (one engine's ranks) and connect a Session over `tensors` to that engine:
    the message it was refused with ("" if it was not) and the engines of the peers it opened."""
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="refusals", is_server=True, timeout=2)
    for table in tables:
        rendezvous.publish(dataclasses.replace(table, job_id="refusals", transport="mooncake"))
    transport = CountingTransport()
    with Session(source=DictSource(tensors), transport=transport, rendezvous=rendezvous) as session:
        try:
            session.connect([tables[0].engine_id])
        except ConnectError as exc:
            return str(exc), transport.opened
    return "", transport.opened
