"""The chaos test (#31, #46): `tests.helpers.chaos`'s seeded schedule of training steps and updates
with faults, on loopback and in a cluster in a box (where network faults join the others), and
`tests.helpers.cache_chaos`'s of poisoned and stale layout cache entries.

`P2PSYNC_CHAOS_STEPS` (default 100) and `P2PSYNC_CHAOS_SEED` (default a fixed one) choose the
schedule; a failure names the seed and step.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

from tests.helpers.box import BoxRun, unavailable as box_unavailable  # noqa: E402
from tests.helpers.cache_chaos import run_cache_chaos  # noqa: E402
from tests.helpers.chaos import run_chaos  # noqa: E402

STEPS = int(os.environ.get("P2PSYNC_CHAOS_STEPS", "100"))
SEED = int(os.environ.get("P2PSYNC_CHAOS_SEED", "20261202"))

#: The schedule in the box: enters a namespace of its own, shapes it, joins the driver's place
#: (before any thread starts), then runs; its last line is what was drawn, as JSON.
IN_A_BOX = """
if __name__ == "__main__":  # the schedule's processes are spawned: they import this file
    import json, sys
    from pathlib import Path
    from p2psync.worlds import netbox
    from tests.helpers.chaos import BOX, DRIVER
    netbox.enter_namespace()
    netbox.shape(BOX)
    netbox.join(BOX, *DRIVER)
    from tests.helpers.chaos import run_chaos
    tried = run_chaos(Path(sys.argv[1]), steps=int(sys.argv[2]), seed=int(sys.argv[3]), box=BOX)
    print(json.dumps(tried), flush=True)
"""


@pytest.fixture(scope="module")
def box_schedule(tmp_path_factory):
    """The schedule in a box, started in a process of its own when first asked for: the two
    schedules mostly wait (timeouts, restarts), so the loopback one runs beside it. None, with
    the reason, where the box cannot be made."""
    if why := box_unavailable():
        yield None, why
        return
    folder = tmp_path_factory.mktemp("chaos-box")
    script = folder / "chaos_in_a_box.py"
    script.write_text(IN_A_BOX)
    run = BoxRun(script, [str(folder), str(STEPS), str(SEED)])
    try:
        yield run, ""
    finally:
        run.stop()


def test_chaos_schedule_keeps_every_serving_engine_on_one_acknowledged_version(tmp_path, box_schedule):
    tried = run_chaos(tmp_path, steps=STEPS, seed=SEED)
    drawn = ("kill_engine", "kill_trainer", "poke", "concurrent", "stall", "late_finish_stopped", "dead_at_connect",
             "intruder")
    assert all(tried.get(fault) for fault in drawn), tried


def test_chaos_schedule_with_network_faults_in_a_cluster_in_a_box(box_schedule):
    run, why = box_schedule
    if run is None:
        pytest.skip(why)
    tried = run.result(timeout=1200)
    assert tried.get("cut") and tried.get("lossy"), tried


def test_chaos_schedule_with_poisoned_and_stale_layout_cache_entries(tmp_path):
    tried = run_cache_chaos(tmp_path, steps=STEPS, seed=SEED)
    assert tried.get("poisoned") and tried.get("stale") and tried.get("restart"), tried
    ways = {name for name in tried if name.startswith(("poison ", "wrong "))}
    assert len(ways) >= 5, f"only {sorted(ways)} of the poisons were drawn"
