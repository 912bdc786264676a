"""Engines outlive their trainers (issue #44): where the rendezvous lived in trainer rank 0 and
that process dies, the engines keep serving their last version, publish their tables again to
the store a restarted trainer world opens at the job's address, and take that world's updates
(the first in full). The oracle is the trainer model's own state dict, read back from each
engine's memory."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from p2psync.core.control import post
from p2psync.core.rendezvous import Rendezvous
from p2psync.worlds.launch import free_port
from p2psync.worlds.processes import context, process
from tests.helpers.engines import Engines, small_model, wait_for

pytest.importorskip("mooncake.engine", reason="the engines are written over Mooncake (extra 'mooncake')")

JOB = "restart"


def trainer_world(port: int, seed: int, versions: list[str], out: str, die: bool) -> None:
    """One trainer world: hosts the job's rendezvous at `port`, connects to engines a and b,
    updates them with `small_model(seed)` under each of `versions` (after the first, a small
    change: deltas), saves its reports to `out`, and then ends: killed (`die`), as a crashed rank ends."""
    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.trainer.session import Session

    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=JOB, is_server=True, timeout=30)
    model = small_model(seed)
    session = Session(
        source=FSDP2Source(model), rendezvous=rendezvous, transport="mooncake", check=True, transfer_timeout=10,
        delta=True,
    )
    session.connect(["a", "b"])
    reports = []
    for step, version in enumerate(versions):
        if step:
            with torch.no_grad():
                next(model.parameters())[0, :3] += 1.0
        report = session.update(version)
        reports.append((report.ok, sum(e.bytes for e in report.engines.values())))
    urls = {e: tables[0].control_url for e, tables in session.tables.items()}
    torch.save((reports, urls, {n: p.detach().clone() for n, p in model.state_dict().items()}), out)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    session.close()


def run_world(port: int, seed: int, versions: list[str], die: bool, out: Path) -> tuple[list, dict[str, str], dict]:
    proc = process(context(), trainer_world, (port, seed, versions, str(out), die))
    proc.start()
    proc.join(180)
    assert not proc.is_alive() and out.exists(), f"the trainer world ended with {proc.exitcode} and no report"
    return torch.load(out)


def held_bytes(url: str, token: str) -> dict[str, torch.Tensor]:
    """Every parameter as the engine at `url` holds it (its test route `state`)."""
    raw = post(url, "state", token=token, timeout=10)
    return {n: torch.frombuffer(bytearray(bytes.fromhex(h)), dtype=torch.float32) for n, h in raw.items()}


def test_engines_keep_serving_and_publish_again_to_a_restarted_trainer_world(tmp_path):
    port = free_port()
    job = Rendezvous(host="127.0.0.1", port=port, job_id=JOB, timeout=60)  # the address and token the job names
    group = Engines(job, "mooncake")
    try:
        group.start("a", seed=1)
        group.start("b", seed=2)
        first, urls, _ = run_world(port, seed=10, versions=["w1-v1"], die=True, out=tmp_path / "first.pt")
        assert first == [(True, first[0][1])], first

        # The store died with trainer rank 0: the engines serve on, their last version.
        for engine_id, url in urls.items():
            status = post(url, "info", token=job.token(), timeout=10)
            assert (status["version"], status["serving"]) == ("w1-v1", True), (engine_id, status)

        second, _, weights = run_world(port, seed=20, versions=["w2-v1", "w2-v2"], die=False, out=tmp_path / "second.pt")
        (ok1, full_bytes), (ok2, delta_bytes) = second
        assert ok1 and ok2, second
        assert delta_bytes < full_bytes / 4, (full_bytes, delta_bytes)  # the first in full, then a delta
        for engine_id, url in urls.items():
            held = held_bytes(url, job.token())
            for name, tensor in weights.items():
                assert torch.equal(held[name], tensor.reshape(-1)), f"engine {engine_id}: {name} differs"
    finally:
        group.close()
