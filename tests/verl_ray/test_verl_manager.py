"""verl 0.9.1's own CheckpointEngineManager drives p2psync's verl backend into 2 real sglang 0.5.23 servers.

Everything but the trainer worker is verl's, sglang's and p2psync's own code (the stand-in: trainer.py; verl and
sglang version-skew patches: compat.py). Run in a fresh network namespace with only `lo` up, so every address is
loopback. The oracle: after every update, each server's greedy continuation of two prompts equals transformers'
greedy continuation under the trainer's weights of that update (float32: sglang and transformers agree to ~1e-6),
and before the first update it equals the one under the checkpoint the servers loaded, which differs.
Needs root (unshare), verl 0.9.1 and sglang 0.5.23 (tox -e verl-sglang); ~5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl not installed (tox -e verl-sglang installs verl 0.9.1)")
pytest.importorskip("sglang", reason="sglang not installed (tox -e verl-sglang installs sglang 0.5.23)")
pytest.importorskip("ray", reason="ray not installed")

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                       reason="needs root: runs the job under `unshare -n` (loopback only)"),
    pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None,
                       reason="needs unshare and ip (util-linux, iproute2)"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = int(os.environ.get("P2PSYNC_VERL_TIMEOUT", "1200"))
#: The job in the namespace `unshare -n` made, then every process left in it ended by pid (Ray's
#: raylet, GCS and workers; never `ray stop`, which ends Ray processes machine-wide).
JOB_IN_NAMESPACE = (
    'ip link set lo up; "$0" -m tests.verl_ray.scenario "$1"; rc=$?; me=$(readlink /proc/$$/ns/net); '
    'for p in /proc/[0-9]*; do pid=${p#/proc/}; [ "$pid" != $$ ] && [ "$(readlink $p/ns/net 2>/dev/null)" = "$me" ] '
    '&& kill -9 "$pid" 2>/dev/null; done; exit $rc'
)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_manager")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", SGLANG_HOST_IP="127.0.0.1", MOONCAKE_PROTOCOL="tcp")
    cmd = ["unshare", "-n", "bash", "-c", JOB_IN_NAMESPACE, sys.executable, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)
    (out / "job.log").write_text(proc.stdout)
    path = out / "result.json"
    assert proc.returncode == 0 and path.exists(), f"job failed (rc {proc.returncode}):\n{proc.stdout[-8000:]}"
    return json.loads(path.read_text())


def _expected(result, update):
    from .model import base_state_dict, greedy, trained_state_dict

    d = result["model_dir"]
    sd = base_state_dict(d) if update == 0 else trained_state_dict(d, update)
    return [greedy(d, sd, p, result["new_tokens"]) for p in result["prompts"]]


def test_every_update_ok_and_reported_per_engine_id(result):
    assert [u["global_steps"] for u in result["updates"]] == [None, 1, 2]
    for u in result["updates"]:
        assert u["ok"], u.get("error")
        assert u["metrics"]["p2psync/bytes"] > 0, u["metrics"]
        # the trainer's backend reported under engine ids rollout-0 and rollout-1, each updated
        # (verl/done/<engine id>/<version>: another id, or an engine left out, leaves its key unset)
        assert u["reported"] == {"rollout-0": {"ok": True, "error": None},
                                 "rollout-1": {"ok": True, "error": None}}, u["reported"]


def test_servers_serve_the_trainers_weights_after_every_update(result):
    before = _expected(result, 0)
    for servers in result["before"]:
        assert [g["tokens"] for g in servers] == before, "server did not load the checkpoint"
    for u in result["updates"]:
        want = _expected(result, u["update"])
        assert want != before, "oracle cannot tell this update from the loaded checkpoint"
        for replica, servers in enumerate(u["servers"]):
            got = [g["tokens"] for g in servers]
            assert got == want, (f"update {u['update']}: replica {replica} generates {got}, the trainer's weights "
                                 f"{want} (loaded checkpoint: {before})")


def test_global_steps_follow_the_updates(result):
    for u in result["updates"]:
        for servers in u["servers"]:
            assert all("global_steps" in g["extra_fields"] for g in servers), servers
            assert [g["extra_fields"]["global_steps"] for g in servers] == [u["global_steps"]] * len(servers)
