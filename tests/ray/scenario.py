"""A Ray driver for the emulated nodes (run inside node 0): the example job's own actor classes
through what a job meets in its life. Prints one JSON line for the test to read.

- restart: the trainer actors are killed after an update and started again; the engines serve
  their last version meanwhile, and the new world's first update is full, then deltas;
- add: a third replica joins between updates, with no code but its actor's name;
- loopback (`--loopback`, alone): one replica is started with P2PSYNC_HOST=127.0.0.1, so that it
  publishes an address only its own node reaches; the trainers' connect must refuse it;
- cut: one node's link is pulled (`ip -n SWITCH link set portN down`) before an update: its
  engines are reported stale by name and the others updated; plugged back, it takes the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
import ray.exceptions

#: Seconds any one call may take before the scenario gives up (a hang fails, not stalls): no speed
#: bound. On a 2-core machine busy with other tests, an actor's first call (its worker starts and
#: imports torch) and the connect behind it took 100 s.
CALL = 300

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "ray_two_nodes.py"


def held_by(rollout: Any) -> Any:
    """What `rollout` holds (its `state()`, read only): asked again while Ray calls its actor
    temporarily unavailable, as after a cut link is mended Ray's connection to the node can be
    reset once before it reconnects."""
    deadline = time.monotonic() + CALL
    while True:
        try:
            return ray.get(rollout.state.remote(), timeout=CALL)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def load_example():
    spec = importlib.util.spec_from_file_location("ray_two_nodes", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import it by name
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--switch", required=True, help="the emulated switch's namespace (RayNodes.switch)")
    parser.add_argument("--job", required=True)
    parser.add_argument("--loopback", action="store_true")
    args = parser.parse_args()
    ex = load_example()
    ray.init(address=args.address)
    out: dict = {}

    def trainers(port: int) -> list:
        master = f"{ray.get(ex.node_address.options(**ex.pinned(0)).remote())}:{port}"
        return [ex.Trainer.options(**ex.pinned(0)).remote(rank, 2, master, args.job, transfer_timeout=8.0)
                for rank in range(2)]

    def step(world: list, rollouts: dict, version: str) -> dict:
        reports = ray.get([t.train_and_sync.remote(version) for t in world], timeout=CALL)
        full = ray.get([t.full_state.remote() for t in world], timeout=CALL)[0]
        held = {e: held_by(r) for e, r in rollouts.items()}
        return {"report": reports[0], "equal": {e: h == full for e, h in held.items()}}

    if args.loopback:
        loopback = {"env_vars": {"P2PSYNC_HOST": "127.0.0.1"}}
        rollout = ex.Rollout.options(name="rollout_0", runtime_env=loopback, **ex.pinned(1)).remote(args.job)
        ray.get(rollout.describe.remote(), timeout=CALL)
        world = trainers(29520)
        try:
            ray.get([t.connect.remote(["rollout-0"]) for t in world], timeout=CALL)
            out["refused"] = None
        except ray.exceptions.RayTaskError as exc:
            out["refused"] = str(exc.cause)
        print(json.dumps(out))
        return

    rollouts = {f"rollout-{i}": ex.Rollout.options(name=f"rollout_{i}", **ex.pinned(node)).remote(args.job)
                for i, node in ((0, 1), (1, 2))}
    world = trainers(29521)
    ray.get([t.connect.remote(sorted(rollouts)) for t in world], timeout=CALL)
    out["first"] = step(world, rollouts, "a-1")

    for t in world:  # the trainer world ends as a crash ends it
        ray.kill(t)
    out["serving_after_restart"] = {e: ray.get(r.describe.remote(), timeout=CALL)["version"] for e, r in rollouts.items()}
    world = trainers(29522)
    ray.get([t.connect.remote(sorted(rollouts)) for t in world], timeout=CALL)
    out["restarted"] = [step(world, rollouts, "b-1"), step(world, rollouts, "b-2")]

    rollouts["rollout-2"] = ex.Rollout.options(name="rollout_2", **ex.pinned(1)).remote(args.job)
    out["added_id"] = ray.get(rollouts["rollout-2"].describe.remote(), timeout=CALL)["engine_id"]
    ray.get([t.connect.remote(sorted(rollouts)) for t in world], timeout=CALL)
    out["added"] = step(world, rollouts, "b-3")

    subprocess.run(["ip", "-n", args.switch, "link", "set", "port2", "down"], check=True)  # node 2: rollout-1
    cut = {e: r for e, r in rollouts.items() if e != "rollout-1"}
    reports = ray.get([t.train_and_sync.remote("b-4") for t in world], timeout=CALL)
    full = ray.get([t.full_state.remote() for t in world], timeout=CALL)[0]
    out["cut"] = {"report": reports[0], "equal": {e: held_by(r) == full for e, r in cut.items()}}
    subprocess.run(["ip", "-n", args.switch, "link", "set", "port2", "up"], check=True)
    ray.get([t.connect.remote(sorted(rollouts)) for t in world], timeout=CALL)
    out["mended"] = step(world, rollouts, "b-5")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
