"""Every p2psync log line says who wrote it (issue #47): the job, the side and the rank, in an
application's process whose logging is its own, and as JSON where asked. Each case runs in a
process of its own (logging is process-wide); the oracle is the text on its stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

#: An application that owns its logging, then p2psync names the process and logs.
APP = """
import logging, sys
logging.basicConfig(format="APP %(levelname)s %(message)s", level=logging.INFO, stream=sys.stderr)
from p2psync.core.logs import identify
logging.getLogger("p2psync.engine.endpoint").warning("before any identify")
identify(job="rl", side=sys.argv[1], rank=int(sys.argv[2]))
logging.getLogger("p2psync.engine.endpoint").warning("paused for %s", "v3")
logging.getLogger("someone.else").warning("not ours")
"""


def run_app(side: str, rank: int, **env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(APP), side, str(rank)], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("P2PSYNC_LOG")} | env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_lines_in_an_applications_own_format_carry_job_side_and_rank():
    assert run_app("engine rollout-1", 0) == [
        "APP WARNING before any identify",
        "APP WARNING [job rl engine rollout-1 rank 0] paused for v3",
        "APP WARNING not ours",
    ]
    assert run_app("trainer", 3)[1] == "APP WARNING [job rl trainer 3] paused for v3"


def test_json_lines_where_the_job_asks_for_them():
    lines = run_app("engine rollout-1", 0, P2PSYNC_LOG_FORMAT="json")
    ours = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(o["job"], o["side"], o["rank"], o["level"], o["logger"], o["message"]) for o in ours] == [
        ("rl", "engine rollout-1", 0, "WARNING", "p2psync.engine.endpoint", "paused for v3"),
    ]
    assert "APP WARNING not ours" in lines  # the application's own lines stay its own


def test_a_session_and_an_endpoint_name_their_process(monkeypatch):
    from p2psync.core import logs
    from p2psync.core.rendezvous import Rendezvous
    from p2psync.trainer.session import Session
    from tests.helpers.doubles import DictSource

    import torch

    monkeypatch.setattr(logs, "_who", {})
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="named", is_server=True, timeout=5)
    with Session(source=DictSource({"w": torch.zeros(2)}), rendezvous=rendezvous, transport="samehost"):
        assert logs.who() == "job named trainer 0"
    from p2psync.adapters.torch import serve

    endpoint = serve(torch.nn.Linear(2, 2), engine_id="e7", rendezvous=rendezvous, transport="samehost")
    try:
        assert logs.who() == "job named engine e7 rank 0"
    finally:
        endpoint.close()
