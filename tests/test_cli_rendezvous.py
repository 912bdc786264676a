"""`p2psync rendezvous` (issue #44): a job's rendezvous on its own, so that engines and
trainers that come and go meet where none of them hosts it. The oracle: the trainer model's
own state dict against the bytes each engine holds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.control import post
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer.session import Session
from p2psync.worlds.launch import free_port
from tests.helpers.engines import Engines, small_model

pytest.importorskip("mooncake.engine", reason="the engines are written over Mooncake (extra 'mooncake')")


def test_trainers_that_come_and_go_reach_engines_through_a_standalone_rendezvous():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "p2psync.cli", "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, text=True,
    )
    job = Rendezvous(host="127.0.0.1", port=port, job_id="standalone", timeout=30)
    group = Engines(job, "mooncake")
    try:
        assert f"serving at 127.0.0.1:{port}" in server.stdout.readline()
        group.start("a", seed=1)
        for version, seed in (("t1", 10), ("t2", 20)):  # two trainers, one after the other
            model = small_model(seed)
            with Session(source=FSDP2Source(model), rendezvous=Rendezvous(
                    host="127.0.0.1", port=port, job_id="standalone", timeout=30), transport="mooncake", check=True,
                    transfer_timeout=10) as session:
                session.connect(["a"])
                assert session.update(version).ok
                url = session.tables["a"][0].control_url
        held = post(url, "state", token=job.token(), timeout=10)
        for name, tensor in small_model(20).state_dict().items():
            got = torch.frombuffer(bytearray(bytes.fromhex(held[name])), dtype=torch.float32)
            assert torch.equal(got, tensor.reshape(-1)), name
    finally:
        group.close()
        server.terminate()
        assert server.wait(10) == 0
