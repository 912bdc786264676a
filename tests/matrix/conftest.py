"""The engine worlds the round trips of this folder run: one per engine kind (and device),
started once, when its first round trip runs, with every run a collected test asks for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from p2psync.worlds import World
from p2psync.worlds.options import SESSION_WAYS, trainer_kind
from p2psync.conformance.plugin import combination
from tests.helpers.matrix import BRIDGE_MODEL, WORLDS


class Worlds:
    """The session's worlds, made on first use from the round trips collected for them."""

    def __init__(self, session: pytest.Session, folder: Path) -> None:
        self.session = session
        self.folder = folder
        self.worlds: dict[tuple[str, str, bool], World] = {}

    def round_trip(self, trainer: str, engine: str, transport: str, device: str = "cpu", via: str = "-") -> object:
        """The round trip of one combination, from its engine's world (Megatron-Bridge's runs
        share a world of their own model); `via` "gather-free" or "delta" runs the trainer's
        session that way (`SESSION_WAYS`)."""
        bridge = trainer == "megatron-bridge"
        key = (engine, device, bridge)
        if key not in self.worlds:
            runs = tuple(dict.fromkeys(
                (trainer_kind(c["trainer"], c.get("via", "-")), c["transport"]) for c in map(combination, self.session.items)
                if c and c.get("engine") == engine and c["device"] == device and c.get("via", "-") in SESSION_WAYS
                and c.get("transport", "-") != "-" and c.get("trainer", "-") != "-"
                and (c["trainer"] == "megatron-bridge") == bridge
            ))
            opts = replace(WORLDS[engine], model=BRIDGE_MODEL) if bridge else WORLDS[engine]
            dump = self.folder / f"{engine}-{device}{'-bridge' if bridge else ''}"
            self.worlds[key] = World(replace(opts, runs=runs, device=device, dump_dir=str(dump)))
        return self.worlds[key].round_trip(trainer_kind(trainer, via), transport)


@pytest.fixture(scope="session")
def worlds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    return Worlds(request.session, tmp_path_factory.mktemp("worlds"))
