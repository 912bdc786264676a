"""A gloo world of processes, each running one function and reporting what it found: the
fixtures of tests that run a function on every rank."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest

from p2psync.worlds import free_port
from p2psync.worlds.processes import context, process


def run_ranks(
    main: Callable[..., dict[str, Any]], world: int, *args: Any, timeout: float = 120.0
) -> dict[int, dict[str, Any]]:
    """Run `main(rank, *args)` on ranks 0..world-1 of a gloo world; every rank's returned dict,
    by rank. The test fails where a rank raised or never reported, naming it."""
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [process(ctx, _rank, (main, rank, world, port, args, results)) for rank in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=timeout)
            got[rank] = out
    except queue.Empty:
        pytest.fail(f"only ranks {sorted(got)} reported: a collective hung")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, out in got.items():
        assert "error" not in out, (rank, out["error"])
    return got


def _rank(main: Callable[..., dict[str, Any]], rank: int, world: int, port: int, args: tuple[Any, ...],
          results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = main(rank, *args)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": f"{type(exc).__name__}: {exc}"}
    results.put((rank, out))
    dist.destroy_process_group()
