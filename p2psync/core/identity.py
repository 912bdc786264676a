"""Engine ids from the framework's identity of each replica, so N replicas need no code.

An engine id may be a template: `rollout-{replica}`. Its fields:
- `replica`: `$P2PSYNC_REPLICA`, else the first number in the name of the Ray actor this
  process runs in (verl names its server actors `sglang_server_<replica>_<node>`, and a
  framework's own actors `rollout_3`, `engine-3` and the like work alike);
- `actor`: the Ray actor's name;
- whatever the caller adds (`extra`).
A field that no source gives leaves the template unexpanded where `partial` asks (a later
process fills it in), else is an error naming the template and the fields there are.
"""

from __future__ import annotations

import os
import re
import string
import sys
from collections.abc import Mapping

REPLICA_ENV = "P2PSYNC_REPLICA"


def expand_engine_id(template: str, extra: Mapping[str, object] | None = None, *, partial: bool = False) -> str:
    """`template` with its fields filled in (see the module's docstring)."""
    if "{" not in template:
        return template
    fields = {**identity_fields(), **{k: str(v) for k, v in (extra or {}).items()}}
    wanted = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = [name for name in wanted if name not in fields]
    if missing and not partial:
        raise ValueError(
            f"engine id template {template!r} names {', '.join(missing)}, which nothing here gives "
            f"(known here: {', '.join(sorted(fields)) or 'none'}; set ${REPLICA_ENV} or run inside a named Ray actor)"
        )
    return template.format_map({**{name: "{" + name + "}" for name in missing}, **fields})


def identity_fields() -> dict[str, str]:
    """What this process knows of its place in the job."""
    fields: dict[str, str] = {}
    actor = _ray_actor_name()
    if actor:
        fields["actor"] = actor
        number = re.search(r"\d+", actor)
        if number:
            fields["replica"] = number.group()
    if os.environ.get(REPLICA_ENV):
        fields["replica"] = os.environ[REPLICA_ENV]
    return fields


def _ray_actor_name() -> str | None:
    ray = sys.modules.get("ray")  # never imported here: only where the job runs under Ray
    if ray is None or not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_actor_name() or None
    except Exception:  # noqa: BLE001 - a driver or task, not an actor
        return None
