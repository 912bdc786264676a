"""Engine memory is closed to a process without the job's token (#46, item 3): on this host,
with the engine's tables read from the rendezvous (anyone may), such a process opens its own
Mooncake Transfer Engine and writes into and reads from every range a serving engine
published, and calls every control route. Its writes and reads are refused, the routes answer
403, and the engine keeps serving exactly the bytes of the model the trainer sent (torch's state
dict: the oracle), before and after the next update, and after an update given up on. Where
the transport cannot refuse, the engine catches the changed bytes and stops serving them."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import engines, small_model, train_step, wait_for  # noqa: E402
from tests.helpers.intruder import Attack, attack  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.core.control import post  # noqa: E402
from p2psync.core.digest import byte_view, digest  # noqa: E402
from p2psync.core.errors import ControlError  # noqa: E402
from p2psync.engine.client import EndpointControl  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402


def oracle(model: torch.nn.Module) -> dict[str, str]:
    """The bytes of the model the trainer sent, as torch's state dict holds them (hex)."""
    return {name: t.reshape(-1).view(torch.uint8).numpy().tobytes().hex() for name, t in model.state_dict().items()}


def held(session: Session, engine: str) -> dict[str, str]:
    """The engine's bytes (hex), as its own route reads them (while it serves)."""
    table = session.tables[engine][0]
    return post(table.control_url, "state", token=session.token, timeout=10)


def digests_match(session: Session, engine: str, model: torch.nn.Module) -> bool:
    """Whether the engine's digests of its parameters equal those of the oracle's bytes (also
    while it is out of serving, when its own routes do not answer)."""
    table = session.tables[engine][0]
    state = model.state_dict()
    regions = {p.name: [(0, p.nbytes)] for p in table.params}
    got = post(table.control_url, "digest", {"regions": regions}, token=session.token, timeout=10)["digests"]
    return got == {name: digest(byte_view(state[name]), spans) for name, spans in regions.items()}


def status(session: Session, engine: str) -> tuple[str | None, bool]:
    table = session.tables[engine][0]
    answer = post(table.control_url, "info", token=session.token, timeout=10)
    return answer["version"], answer["serving"]


def assert_refused(attack: Attack, session: Session, engine: str) -> None:
    assert attack.writes and attack.routes, attack
    assert not attack.landed, f"the intruder's writes landed at {attack.landed}"
    assert not attack.read_back, f"the intruder read the engine's memory at {attack.read_back}"
    assert not attack.leaked, f"the intruder's reads brought back the engine's bytes at {attack.leaked}"
    assert not attack.answered, f"control routes answered the intruder: {attack.answered}"


def test_a_process_without_the_token_can_neither_change_nor_read_a_serving_engines_weights():
    model = small_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with engines(job_id="intruder") as group:
        group.start("a")
        rendezvous = group.rendezvous
        with Session(source=FSDP2Source(model), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["a"])
            for version in ("v1", "v2"):
                train_step(model, optimizer, int(version[1:]))
                report = session.update(version)
                assert report.engines["a"].ok and report.engines["a"].checked, report.format()
                want = oracle(model)
                assert held(session, "a") == want

                assert_refused(attack(rendezvous.host, rendezvous.port, rendezvous.job_id, "a"), session, "a")
                assert held(session, "a") == want, "the engine's bytes changed under the intruder"
                assert status(session, "a") == (version, True)

            # An update the trainer gave up on: the engine stays out of serving, and its memory
            # is closed again at once (not only at the next update's end).
            control = EndpointControl(session.tables["a"], timeout=10, token=session.token)
            control.pause("v3", lease=60.0, mode="abort")
            control.fail("v3", "given up by the test")
            wait_for(lambda: status(session, "a") == ("v2", False), 10, "engine a out of serving")
            assert_refused(attack(rendezvous.host, rendezvous.port, rendezvous.job_id, "a"), session, "a")
            assert digests_match(session, "a", model)

            train_step(model, optimizer, 4)
            report = session.update("v4")  # the memory opens again for the next update
            assert report.engines["a"].ok and report.engines["a"].checked, report.format()
            assert held(session, "a") == oracle(model)
            assert status(session, "a") == ("v4", True)


def test_where_the_transport_cannot_conceal_the_engine_catches_changed_bytes_and_stops_serving_them():
    """Mooncake told to keep the memory registered stands for the transports that cannot refuse
    (RDMA inside its fabric, NIXL, the same-host transport): the intruder's writes land and its
    reads succeed, and the engine, verifying its weights while it serves, finds bytes changed
    outside an update and stops serving them until the next update, which restores the oracle."""
    model = small_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"transport_options": {"conceal": False}, "verify_seconds": 0.5}
    with engines(job_id="intruder-open", options=options) as group:
        group.start("a")
        rendezvous = group.rendezvous
        with Session(source=FSDP2Source(model), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["a"])
            train_step(model, optimizer, 1)
            assert session.update("v1").engines["a"].ok
            assert held(session, "a") == oracle(model)

            intrusion = attack(rendezvous.host, rendezvous.port, rendezvous.job_id, "a")
            assert intrusion.landed and intrusion.read_back, "Mooncake refused although told not to conceal"
            assert not intrusion.answered, f"control routes answered the intruder: {intrusion.answered}"
            wait_for(lambda: status(session, "a") == ("v1", False), 10, "engine a out of serving")
            table = session.tables["a"][0]
            stale = post(table.control_url, "info", token=session.token, timeout=10)["stale"]
            assert "changed outside an update" in stale, stale
            with pytest.raises(ControlError, match="503"):
                held(session, "a")  # its own routes serve nothing of the changed bytes

            train_step(model, optimizer, 2)
            report = session.update("v2")
            assert report.engines["a"].ok and report.engines["a"].checked, report.format()
            assert held(session, "a") == oracle(model)
            assert status(session, "a") == ("v2", True)
