"""A trainer session's connect to an engine rank that must be refused: the error text, with
nothing written (no transport peer opened, the engine never paused for an update, its memory
unchanged)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.control import post
from p2psync.engine.endpoint import EngineEndpoint
from p2psync.core.errors import ConnectError
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer.session import Session
from p2psync.core.transport import Transport


class NoPeers(Transport):
    """The trainer's transport counts the peers a session opens (a refused connect opens none, so it
    cannot write); an engine's exposes nothing."""

    name = "mooncake"

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[Any] = []

    def expose(self, tensors):
        return {"session": "127.0.0.1:1"}

    def register_buffer(self, buffer):
        pass

    def unregister_buffer(self, buffer):
        pass

    def open(self, table):
        self.opened.append(table.target)
        raise AssertionError("a refused connect opened a peer")

    def close(self):
        pass


def refused(endpoint: EngineEndpoint, rendezvous: Rendezvous, tensors: Mapping[str, torch.Tensor]) -> str:
    """Fill the served rank's memory with 0xA5 bytes, connect a one-rank FSDP2 trainer holding HF
    `tensors` to it, assert the connect is refused with nothing written, close the endpoint; the
    error text."""
    try:
        for t in endpoint.params.values():
            t.view(torch.uint8).fill_(0xA5)
        return _connect_refused(rendezvous, endpoint.engine_id, tensors, endpoint.params)
    finally:
        endpoint.close()


def _connect_refused(
    rendezvous: Rendezvous, engine_id: str, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> str:
    model = torch.nn.Module()
    for name, t in tensors.items():
        model.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t.clone()))
    source = FSDP2Source(model, name_map=lambda name: name.replace("__", "."))
    trainer = NoPeers()
    with Session(source=source, rendezvous=rendezvous, transport=trainer, transfer_timeout=5.0, check=True) as session:
        with pytest.raises(ConnectError) as error:
            session.connect([engine_id])
    table = rendezvous.read_engine(engine_id)[0]
    assert trainer.opened == []
    status = post(table.control_url, "info", token=rendezvous.token(), timeout=5)
    assert (status["version"], status["updating"], status["stale"]) == (None, None, None)  # never paused
    assert all(bool((t.view(torch.uint8) == 0xA5).all()) for t in params.values())
    return str(error.value)
