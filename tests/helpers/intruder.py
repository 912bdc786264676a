"""A process of this host without the job's token, attacking a serving engine (#46, item 3).

It reads an engine's tables from the rendezvous (anyone may), opens a Mooncake Transfer
Engine of its own and, through the engine's published session, tries to write into every
range trainers write (parameters and patch area) and to read every one of them back; then it
calls every control route of every rank, with no token and with a wrong one. It knows no
token: it runs with $P2PSYNC_TOKEN unset and a token directory of its own (empty).
"""

from __future__ import annotations

import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from p2psync.worlds.processes import context, process

#: The endpoint's routes, and the torch test engine's own (`tests.helpers.engines`).
ROUTES = ("pause", "renew", "patch", "finish", "digest", "info", "retire", "held", "fail", "label",
          "state", "poke", "reload")
#: What the intruder writes: a byte no test model's parameter is made of throughout.
JUNK = 0xA5


@dataclass
class Attack:
    """What came of one attack: per (rank, address) the Mooncake status of the write and of the
    read (0: done), whether a read brought back any byte other than the intruder's own junk,
    and per (rank, route, token) the HTTP status of the call."""

    writes: dict[tuple[int, int], int] = field(default_factory=dict)
    reads: dict[tuple[int, int], int] = field(default_factory=dict)
    leaked: list[tuple[int, int]] = field(default_factory=list)
    routes: dict[tuple[int, str, str], int] = field(default_factory=dict)

    @property
    def landed(self) -> list[tuple[int, int]]:
        """Ranges whose write Mooncake reported done."""
        return [where for where, status in self.writes.items() if status == 0]

    @property
    def read_back(self) -> list[tuple[int, int]]:
        """Ranges whose read Mooncake reported done."""
        return [where for where, status in self.reads.items() if status == 0]

    @property
    def answered(self) -> dict[tuple[int, str, str], int]:
        """Route calls answered with anything but 403."""
        return {call: status for call, status in self.routes.items() if status != 403}


def _call(url: str, route: str, token: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["X-P2PSync-Token"] = token
    body = b'{"version": "intruder", "lease": 60, "reason": "intruder", "rollback": true, "incarnation": 99}'
    request = urllib.request.Request(f"{url}/{route}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _attack(host: str, port: int, job_id: str, engine_ids: list[str], answer: Any) -> None:
    os.environ.pop("P2PSYNC_TOKEN", None)
    os.environ.pop("P2PSYNC_TOKEN_FILE", None)
    os.environ["P2PSYNC_TOKEN_DIR"] = tempfile.mkdtemp(prefix="intruder-tokens-")
    import torch
    from mooncake.engine import TransferEngine

    from p2psync.core.host import local_host
    from p2psync.core.rendezvous import Rendezvous

    rendezvous = Rendezvous(host=host, port=port, job_id=job_id, timeout=10)
    tables = {engine_id: rendezvous.read_engine(engine_id) for engine_id in engine_ids}
    attacks = {engine_id: Attack() for engine_id in engine_ids}
    engine = TransferEngine()
    if engine.initialize(local_host(toward=host), "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the intruder's Transfer Engine did not start")
    largest = max(nbytes for ranks in tables.values() for table in ranks for _, nbytes in table.writable)
    junk = torch.full((largest,), JUNK, dtype=torch.uint8)
    loot = torch.full((largest,), JUNK, dtype=torch.uint8)
    for buffer in (junk, loot):
        if engine.register_memory(buffer.data_ptr(), largest) != 0:
            raise RuntimeError("the intruder could not register its own buffers")
    for engine_id, table in ((e, t) for e, ranks in tables.items() for t in ranks):
        attack = attacks[engine_id]
        session = table.transport_info["session"]
        for addr, nbytes in table.writable:
            where = (table.rank, addr)
            attack.writes[where] = engine.transfer_sync_write(session, junk.data_ptr(), addr, nbytes)
            loot.fill_(JUNK)
            attack.reads[where] = engine.transfer_sync_read(session, loot.data_ptr(), addr, nbytes)
            if bool((loot[:nbytes] != JUNK).any()):
                attack.leaked.append(where)
        for route in ROUTES:
            for name, token in (("none", None), ("wrong", "0" * 32)):
                attack.routes[(table.rank, route, name)] = _call(table.control_url, route, token)
    answer.put(attacks)
    answer.close()
    answer.join_thread()  # sent before Mooncake's teardown at exit (which may abort the process)


def attack(host: str, port: int, job_id: str, engine_id: str, timeout: float = 120.0) -> Attack:
    """Run one attack on engine `engine_id` from a process of its own; what came of it."""
    return attack_each(host, port, job_id, [engine_id], timeout)[engine_id]


def attack_each(host: str, port: int, job_id: str, engine_ids: list[str], timeout: float = 120.0) -> dict[str, Attack]:
    """Attack each of `engine_ids` in turn from one process of its own; what came of each."""
    ctx = context()
    answer = ctx.Queue()
    proc = process(ctx, _attack, (host, port, job_id, list(engine_ids), answer), name="intruder",
                       daemon=True)
    proc.start()
    try:
        attacks: dict[str, Attack] = answer.get(timeout=timeout)
        return attacks
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
