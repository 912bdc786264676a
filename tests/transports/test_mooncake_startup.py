"""Mooncake's start-up noise stays out of a good run's log; anything else it says is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from p2psync.transports.mooncake.startup import StartupFailed, initialize_quietly


def say(*lines: str) -> None:
    os.write(2, "".join(line + "\n" for line in lines).encode())  # as C++ does: straight to fd 2


def test_known_noise_is_dropped_and_anything_else_written_back(capfd):
    noise = "E1130 17:22:48.521099 19241 transfer_metadata.cpp:1098] Local segment descriptor not found"
    other = "W1130 17:22:48.521100 19241 rdma.cpp:12] something the user should see"
    result, kept = initialize_quietly(lambda: say(noise, other) or 0)
    assert (result, kept) == (0, [other])
    err = capfd.readouterr().err
    assert other in err and "Local segment descriptor" not in err


def test_a_failed_start_carries_what_mooncake_said():
    def start():
        say("E1130 transfer_engine.cpp:1] bind: Address already in use")
        raise RuntimeError("bind: Address already in use")

    with pytest.raises(StartupFailed) as failed:
        initialize_quietly(start)
    assert isinstance(failed.value.cause, RuntimeError)
    assert failed.value.said == ["E1130 transfer_engine.cpp:1] bind: Address already in use"]


def test_a_mooncake_transport_starts_without_error_or_warning_lines():
    pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
    code = (
        "from p2psync.transports.mooncake.transport import MooncakeTransport\n"
        "t = MooncakeTransport(options={'protocol': 'tcp'})\n"
        "assert t.engine.get_rpc_port() > 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line[:1] in ("E", "W") and line[1:5].isdigit()]
    assert lines == [], lines
