"""p2psync in its users' jobs (issue #44): Ray across emulated nodes, each a network namespace
of its own with a loopback-range address (`p2psync.worlds.raynodes`). The trainers are 2 FSDP2
actors on node 0, the rollout replicas torch engine actors on nodes 1 and 2, all the example's
own classes (docs/examples/ray_two_nodes.py, the multi-node guide's); slime's and miles' updaters
run in stand-ins of their trainer actors with real engine actor handles (tests/ray/slime_job.py). The oracle is outside
p2psync: SHA-256 of each engine's own state dict against torch's full state dict of the trainer."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray jobs need ray (tox -e ray)")
pytest.importorskip("mooncake.engine", reason="the jobs write over Mooncake (extra 'mooncake')")

from p2psync.worlds.netbox import NamespaceError  # noqa: E402
from p2psync.worlds.raynodes import RayNodes, address  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "ray_two_nodes.py"
SCENARIO = ROOT / "tests" / "ray" / "scenario.py"
SLIME_JOB = ROOT / "tests" / "ray" / "slime_job.py"


@pytest.fixture(scope="module")
def nodes():
    with tempfile.TemporaryDirectory(prefix="p2pray-") as folder:  # short: Ray's socket paths sit below it
        try:
            cluster = RayNodes([2, 2, 1], folder)
        except NamespaceError as exc:
            pytest.skip(f"emulated Ray nodes cannot be made here: {exc}")
        with cluster:
            yield cluster


def run_driver(nodes: RayNodes, argv: list[str], env: dict[str, str] | None = None) -> tuple[dict | None, str]:
    done = nodes.run(0, [sys.executable, *argv, "--address", nodes.head], env={"PYTHONPATH": str(ROOT), **(env or {})},
                     timeout=900)  # a hang fails; a loaded machine is slow
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if done.returncode == 0 and lines else None), done.stderr[-6000:]


def test_two_replicas_of_one_job_env_each_get_their_own_id_and_node_address_and_the_trainers_bytes(nodes):
    result, stderr = run_driver(nodes, [str(EXAMPLE), "--job", "ids", "--trainer-node", "0", "--engine-nodes", "1", "2"])
    assert result is not None, stderr
    engines = result["engines"]
    assert [e["engine_id"] for e in engines] == ["rollout-0", "rollout-1"]  # from the actors' names
    for engine, node in zip(engines, (1, 2)):
        assert engine["node"] == address(node)
        assert engine["control_url"].startswith(f"http://{address(node)}:"), engine  # not 127.0.0.1
        assert engine["transport"]["session"].startswith(f"{address(node)}:"), engine
    for update in result["updates"]:
        assert all(r["ok"] for r in update["reports"]), update["reports"][0]["report"]
        assert update["equal"] == {"rollout-0": True, "rollout-1": True}
    assert [u["reports"][0]["delta"] for u in result["updates"]] == [
        {"rollout-0": False, "rollout-1": False}, {"rollout-0": True, "rollout-1": True},
    ]


def test_an_engine_publishing_a_host_local_address_across_nodes_is_refused_naming_the_fix(nodes):
    result, stderr = run_driver(nodes, [str(SCENARIO), "--job", "loopback", "--switch", nodes.switch, "--loopback"])
    assert result is not None, stderr
    refused = result["refused"]
    assert refused and "engine 'rollout-0' rank 0 published the host-local address 'http://127.0.0.1:" in refused
    assert "from another node" in refused and "set $P2PSYNC_HOST in the engine's processes" in refused, refused


def test_trainer_restart_a_third_replica_and_a_cut_link(nodes):
    result, stderr = run_driver(nodes, [str(SCENARIO), "--job", "life",
                                        "--switch", nodes.switch])
    assert result is not None, stderr
    ids = ["rollout-0", "rollout-1"]
    assert result["first"]["report"]["ok"] and result["first"]["equal"] == dict.fromkeys(ids, True)
    # The trainer world died: the engines serve on, their last version.
    assert result["serving_after_restart"] == dict.fromkeys(ids, "a-1")
    full, delta = result["restarted"]
    assert full["report"]["ok"] and full["equal"] == dict.fromkeys(ids, True), full["report"]["report"]
    assert full["report"]["delta"] == dict.fromkeys(ids, False)  # a new world's first update is full
    assert delta["report"]["ok"] and delta["equal"] == dict.fromkeys(ids, True)
    assert delta["report"]["delta"] == dict.fromkeys(ids, True)
    # A third replica, named by its actor alone.
    assert result["added_id"] == "rollout-2"
    assert result["added"]["report"]["ok"] and all(result["added"]["equal"].values()), result["added"]["report"]
    # Node 2's link cut: its engine stale by name, the others updated.
    cut = result["cut"]["report"]
    assert not cut["ok"] and cut["engines"] == {"rollout-0": True, "rollout-1": False, "rollout-2": True}, cut["report"]
    assert result["cut"]["equal"] == {"rollout-0": True, "rollout-2": True}
    mended = result["mended"]
    assert mended["report"]["ok"] and all(mended["equal"].values()), mended["report"]["report"]


def test_slime_and_miles_updaters_in_trainer_actors_with_real_engine_handles(nodes):
    """slime's updater for two steps, its trainer actors killed, miles' in new ones for one: each
    engine, asked through its actor handle as the actors' ci_test asks, serves the updater's
    version, and its bytes equal torch's full state dict of the trainer."""
    result, stderr = run_driver(nodes, [str(SLIME_JOB), "--job", "slime"])
    assert result is not None, stderr
    steps = [*result["slime"], *result["miles"]]
    for number, step in enumerate(steps, start=1):
        assert step["versions"] == [{"updater": str(number), "engines": [str(number)] * 2}] * 2, (number, step)
        assert step["equal"] == [True, True], (number, step)


def test_a_folder_too_long_for_rays_sockets_is_refused_before_anything_starts(tmp_path):
    """Ray's sockets sit ~70 characters below its folder; a socket's path holds 107 bytes. Ray's own
    error comes only from `ray start` on the head; RayNodes names the limit before making a node."""
    folder = tmp_path / ("x" * 40)
    with pytest.raises(ValueError, match=r"too long for its sockets: .* at most 38 characters"):
        RayNodes([1], folder)
    assert not folder.exists()
