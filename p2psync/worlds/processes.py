"""Start a world's processes from a fork server that imported torch once, not each anew.

A spawned process imports torch, torch.distributed and transformers itself: on this
project's 2-core machines a spawned trainer or engine process was ready 3.8-4.4 s after its
start, a process forked from a server that had imported them 0.05 s after (the server
itself starts once, in about 7 s). A world of 2 trainer ranks and 4 engine ranks pays the
import 6 times, and the demo, the bench and the tests start many worlds.

Two things a fork server does not do as spawning does, made up for here:
- it does not pass the parent's environment: each process takes `os.environ` as the parent
  has it at `process()` (a spawned one gets that too);
- its processes are in the network namespace the server started in: where the caller is
  in another one than the server (a process that joined an emulated node), processes are
  spawned instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

#: What the fork server imports once (`preload`): what every trainer and engine process
#: imports, and what an engine adapter's ranks import where its engine is installed.
PRELOAD = [
    "torch", "torch.distributed", "transformers", "p2psync.trainer.session", "p2psync.engine.endpoint",
    "p2psync.adapters.sglang.warm",
]

_server_namespace: int | None = None


def _net_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:  # no /proc (not Linux): no namespaces to tell apart
        return 0


def context() -> Any:
    """A multiprocessing context for a world's processes: the fork server where it can be used
    (Linux, the same network namespace as the server), else spawn."""
    global _server_namespace
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    here = _net_namespace()
    if _server_namespace is None:
        _server_namespace = here
        mp.set_forkserver_preload(["p2psync.worlds.preload"])
    return mp.get_context("forkserver" if here == _server_namespace else "spawn")


def process(ctx: Any, target: Callable[..., None], args: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    """`ctx.Process(target=target, args=args, **kwargs)`, run in this process's environment as it is now."""
    return ctx.Process(target=_in_environment, args=(dict(os.environ), target, *args), **kwargs)


def _in_environment(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
