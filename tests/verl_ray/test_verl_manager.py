"""verl 0.9.1's own CheckpointEngineManager drives p2psync's verl backend into 2 real sglang 0.5.23 servers, across
emulated nodes.

Everything but the trainer worker is verl's, sglang's and p2psync's own code (the stand-in: trainer.py; verl and
sglang version-skew patches: compat.py). The job runs on an emulated Ray cluster of 3 nodes (`p2psync.worlds.
raynodes`: a network namespace each, loopback-range node addresses, 127.0.0.1 reaching no other node): the trainer
on node 0, the two replicas on nodes 1 and 2, found by verl's own placement. No address is set anywhere: every
process publishes its node's. The oracle: after every update, each server's greedy continuation of two prompts
equals transformers' greedy continuation under the trainer's weights of that update (float32: sglang and
transformers agree to ~1e-6), and before the first update it equals the one under the checkpoint the servers
loaded, which differs. Needs root and iproute2, verl 0.9.1 and sglang 0.5.23 (tox -e verl-sglang); ~5 minutes on
2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

pytest.importorskip("verl", reason="verl not installed (tox -e verl-sglang installs verl 0.9.1)")
pytest.importorskip("sglang", reason="sglang not installed (tox -e verl-sglang installs sglang 0.5.23)")
pytest.importorskip("ray", reason="ray not installed")

from p2psync.worlds.netbox import NamespaceError  # noqa: E402
from p2psync.worlds.raynodes import RayNodes, address  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = int(os.environ.get("P2PSYNC_VERL_TIMEOUT", "1200"))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_manager")
    # Ray's sockets live under its folder, whose path must stay short (AF_UNIX: 107 bytes)
    with tempfile.TemporaryDirectory(prefix="verl-ray-") as folder:
        try:
            cluster = RayNodes([4, 4, 4], folder, gpus=[1, 1, 1])
        except NamespaceError as exc:
            pytest.skip(f"emulated Ray nodes cannot be made here: {exc}")
        with cluster:
            done = cluster.run(
                0, [sys.executable, "-m", "tests.verl_ray.scenario", str(out), "--address", cluster.head],
                env={"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                     "HF_HUB_OFFLINE": "1", "MOONCAKE_PROTOCOL": "tcp"}, timeout=TIMEOUT,
            )
    (out / "job.log").write_text(done.stdout + done.stderr)
    path = out / "result.json"
    assert done.returncode == 0 and path.exists(), (
        f"job failed (rc {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return json.loads(path.read_text())


def _expected(result, update):
    from .model import base_state_dict, greedy, trained_state_dict

    d = result["model_dir"]
    sd = base_state_dict(d) if update == 0 else trained_state_dict(d, update)
    return [greedy(d, sd, p, result["new_tokens"]) for p in result["prompts"]]


def test_the_trainer_runs_on_node_0_and_each_replica_on_a_node_of_its_own(result):
    assert result["trainer_nodes"] == [address(0)], result["trainer_nodes"]
    assert sorted(result["replica_nodes"]) == [[address(1)], [address(2)]], result["replica_nodes"]
    hosts = [[a.rsplit(":", 1)[0]] for a in result["server_addresses"]]  # verl's "host:port" of each server
    assert hosts == result["replica_nodes"], result["server_addresses"]


def test_every_update_ok_and_reported_per_engine_id(result):
    assert [u["global_steps"] for u in result["updates"]] == [None, 1, 2]
    for u in result["updates"]:
        assert u["ok"], u.get("error")
        assert u["metrics"]["p2psync/bytes"] > 0, u["metrics"]
        # the trainer's report, in verl's metrics of the update: engines rollout-0 and rollout-1, each updated
        # (another id, or an engine left out, has no metrics of its own)
        engines = {k: v for k, v in u["metrics"].items() if k.startswith("p2psync/engine/") and k.endswith("/ok")}
        assert engines == {"p2psync/engine/rollout-0/ok": 1.0, "p2psync/engine/rollout-1/ok": 1.0}, u["metrics"]


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
