"""Network faults in the cluster in a box: a trainer on node 0 updates two torch engines, each
on a node of its own, over Mooncake. Engine b's link is pulled mid-update: b is reported
stale by name within the transfer timeout plus a margin and is never resumed (it stays out
of serving, as the next trainer finds it), a resumes with the trainer's bytes; once the link
is back, the next update lands exact on both: b fences off the given-up update's writes
(its stalled connection would deliver them whenever TCP retransmits) and takes the new
update's through a new exposure, at once. Over links that lose 6.25% of their packets, or
add 100 ms to each (a netfilter queue holds them), every update lands exact, just slower.
Skipped, naming what is missing, where the machine lacks root, iproute2 or (for latency)
iptables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.box import run_in_box

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

#: The trainer's transfer timeout (seconds).
TIMEOUT = 3.0

#: The box both share: the trainer's node, then a node per engine, 1 Gbit/s links ($LOSS_PERCENT lost,
#: $LATENCY_MS added).
BOX_SCRIPT = """
import os
from p2psync.worlds.netbox import Box, Link
BOX = Box((1, 1, 1), Link(gbit=1.0, loss_percent=float(os.environ.get("LOSS_PERCENT", "0")),
                          latency_ms=float(os.environ.get("LATENCY_MS", "0"))))
"""

#: One engine of `small_model`, joined to node `argv[1]` of the box, its rendezvous at port `argv[2]`.
ENGINE = BOX_SCRIPT + """
import sys
from p2psync.worlds.netbox import join
join(BOX, int(sys.argv[1]), 0)
import threading, torch
from p2psync.adapters.torch import serve
from p2psync.core.logs import configure
from p2psync.core.rendezvous import Rendezvous
from tests.helpers.engines import small_model
engine_id = "ab"[int(sys.argv[1]) - 1]
configure(f"{engine_id} rank 0")
rendezvous = Rendezvous(host="127.0.0.1", port=int(sys.argv[2]), job_id="netfault")
endpoint = serve(small_model(1), engine_id=engine_id, rendezvous=rendezvous, transport="mooncake")
threading.Event().wait()
"""

#: The trainer, joined to node 0 after shaping the box; prints what it saw as JSON.
TRAINER = BOX_SCRIPT + """
import json, os, subprocess, sys, time
from p2psync.worlds.netbox import cut, enter_namespace, join, lost_packets, mend, shape
enter_namespace()
shape(BOX)
join(BOX, 0, 0)
import torch
from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.control import post
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer.session import Session
from tests.helpers.engines import small_model
from tests.helpers.steps import after_step
TIMEOUT = float(sys.argv[2])
rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="netfault", is_server=True, timeout=60)
engines = [subprocess.Popen([sys.executable, sys.argv[1], str(node), str(rendezvous.port)]) for node in (1, 2)]
out = {}
try:
    model = small_model(0)
    session = Session(source=FSDP2Source(model), rendezvous=rendezvous, transport="mooncake", check=True,
                      transfer_timeout=TIMEOUT, bucket_bytes=1)
    session.connect(["a", "b"])
    out["v1"] = session.update("v1").stale
    if BOX.link.loss_percent or BOX.link.latency_ms:  # a poor link: every update lands exact, just slower
        out["degraded"] = []
        for version in ("v2", "v3"):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            started = time.monotonic()
            report = session.update(version)
            out["degraded"].append({"stale": report.stale, "checked": [report.engines[e].checked for e in "ab"],
                                    "seconds": time.monotonic() - started})
        out["lost"] = lost_packets()
    else:  # engine b's link pulled mid-update
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        started = time.monotonic()
        report = session.update("v2", progress=after_step(1, lambda: cut(BOX, 2)))
        out["v2"] = {"stale": report.stale, "seconds": time.monotonic() - started, "b": report.engines["b"].error,
                     "a_checked": report.engines["a"].checked}
        mend()
        info = lambda e: post(rendezvous.read_engine(e)[0].control_url, "info", token=rendezvous.token(), timeout=10)
        out["after_v2"] = {e: {k: info(e)[k] for k in ("version", "serving", "stale")} for e in "ab"}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        report = session.update("v3")
        out["v3"] = {"stale": report.stale, "checked": [report.engines[e].checked for e in "ab"]}
        out["final"] = {e: {k: info(e)[k] for k in ("version", "serving")} for e in "ab"}
    session.close()
finally:
    print(json.dumps(out), flush=True)
    for p in engines:
        p.kill()
    os._exit(0)  # killed engines' Mooncake sessions may abort this process's teardown (issue #31)
"""



def _run(tmp_path: Path, loss_percent: float = 0.0, latency_ms: float = 0.0) -> dict:
    """The trainer script's findings, as JSON."""
    engine, trainer = tmp_path / "engine.py", tmp_path / "trainer.py"
    engine.write_text(ENGINE)
    trainer.write_text(TRAINER)
    env = {"LOSS_PERCENT": str(loss_percent), "LATENCY_MS": str(latency_ms)}
    tools = ("ip", "tc", "iptables-legacy") if latency_ms else ("ip", "tc")
    out = run_in_box(trainer, [str(engine), str(TIMEOUT)], env=env, timeout=300, tools=tools)
    assert out["v1"] == [], out
    return out


def _landed_exact(out: dict) -> bool:
    return [(u["stale"], u["checked"]) for u in out["degraded"]] == [([], [True, True])] * 2


@pytest.mark.slow
def test_over_links_that_lose_packets_every_update_lands_exact(tmp_path):
    out = _run(tmp_path, loss_percent=6.25)
    assert _landed_exact(out) and out["lost"] > 0, out


@pytest.mark.slow
def test_over_links_with_100ms_of_latency_every_update_lands_exact_just_slower(tmp_path):
    out = _run(tmp_path, latency_ms=100.0)
    assert _landed_exact(out) and out["lost"] == 0, out
    # an update's control calls and writes cross the links more than once each way: at least 0.2 s
    assert all(u["seconds"] >= 0.2 for u in out["degraded"]), out


@pytest.mark.slow
def test_a_pulled_link_makes_its_engine_stale_and_the_next_update_lands_on_all(tmp_path):
    out = _run(tmp_path)
    v2 = out["v2"]
    assert v2["stale"] == ["b"] and v2["a_checked"], out
    # b's writes time out once, one lease renewal to it times out, and it is given up on
    assert "engine 'b'" in v2["b"] and v2["seconds"] < 3 * TIMEOUT, out
    assert out["after_v2"]["a"] == {"version": "v2", "serving": True, "stale": None}, out
    assert out["after_v2"]["b"]["serving"] is False and out["after_v2"]["b"]["version"] == "v1", out
    assert out["v3"] == {"stale": [], "checked": [True, True]}, out
    assert out["final"] == {e: {"version": "v3", "serving": True} for e in "ab"}, out
