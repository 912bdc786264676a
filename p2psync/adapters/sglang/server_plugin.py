"""sglang general plugin (entry point group `sglang.srt.plugins`): runs in every sglang process.

- On CPU it lets a real server publish weight memory that Mooncake accepts writes
  into (see `shim.patch_server_for_cpu`).
- With `P2PSYNC_SGLANG_ENDPOINT` set (JSON: `rendezvous` "host:port", `job_id`,
  `engine_id`, optional `transport`, default "mooncake"), each scheduler, once
  its model is loaded, serves p2psync's endpoint over the rank's parameters and
  publishes its table in the rendezvous: for transports sglang does not publish
  for itself (NIXL) and for servers started without sglang's transfer-engine flag.
  Pausing, cache flushing and the weight version then go through the server's
  own HTTP API (see `target.SglangEngineTarget.control`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_ENV = "P2PSYNC_SGLANG_ENDPOINT"
#: Endpoints served by this process, kept alive for its lifetime.
_served: list[Any] = []


def load() -> None:
    import sglang

    from .shim import SGLANG_VERSION, on_model_loaded, patch_server_for_cpu

    if sglang.__version__ != SGLANG_VERSION and not os.environ.get(ENDPOINT_ENV):
        # Installed beside another sglang: stay out of its way rather than fail its server.
        log.warning("p2psync supports sglang %s, not %s: its sglang plugin does nothing", SGLANG_VERSION, sglang.__version__)
        return
    patch_server_for_cpu()
    if os.environ.get(ENDPOINT_ENV):
        on_model_loaded(_serve_rank)


def _serve_rank(model: Any, server_args: Any, model_config: Any, tp_rank: int) -> None:
    from ...core.rendezvous import Rendezvous
    from .endpoint import serve

    settings = json.loads(os.environ[ENDPOINT_ENV])
    host, port = settings["rendezvous"].rsplit(":", 1)
    rendezvous = Rendezvous(host=host, port=int(port), job_id=settings["job_id"])
    server_url = f"http://{server_args.host}:{server_args.port}"
    _served.append(
        serve(
            model, server_args, model_config, engine_id=settings["engine_id"], rank=tp_rank,
            rendezvous=rendezvous, transport=settings.get("transport", "mooncake"), extra={"server_url": server_url},
        )
    )
