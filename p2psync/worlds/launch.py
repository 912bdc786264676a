"""Processes on one machine: a rendezvous hosted by the launcher, engine-rank processes that
live for the whole run, and trainer worlds started against them one after another.

A process main is a plain function, so that `multiprocessing` can start it by name (from a fork
server that imported torch once: `processes`):
`engine(index, opts, port, stop)` serves until `stop` is set; `trainer(rank, opts, port,
results)` joins its world through the launcher's store, and trainer rank 0 puts in `results`
any number of `Part(value)` as it goes, then its final value. A process that dies fails its
world at once, not at a timeout.
"""

from __future__ import annotations

import queue
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .processes import context, process

if TYPE_CHECKING:
    from ..core.rendezvous import Rendezvous

#: How long the launcher waits for a stopped process to exit before killing it (and failing its
#: world). Tearing down a process that holds torch, transformers and Megatron took 18 s at a
#: load average of 25 on a 2-core machine, and over 60 s once.
JOIN_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Part:
    """A piece of a trainer world's result, sent before the world ends (kept if it fails later)."""

    value: Any


@dataclass
class WorldOutcome:
    """One trainer world: the parts rank 0 sent, its final value, and why it failed (or "")."""

    parts: list[Any] = field(default_factory=list)
    value: Any = None
    error: str = ""


def launch(
    opts: Any, engine: Callable[..., None], trainer: Callable[..., None], engine_processes: int | None = None
) -> Any:
    """Host the rendezvous, start `engine_processes` (default `opts.engines`) engine processes and
    `opts.trainers` trainer ranks, return what trainer rank 0 finished with, stop everything.

    Raises RuntimeError if any process failed.
    """
    (outcome,) = launch_worlds(opts, engine, [trainer], engine_processes)
    if outcome.error:
        raise RuntimeError(outcome.error)
    return outcome.value


def launch_worlds(
    opts: Any,
    engine: Callable[..., None],
    trainers: Sequence[Callable[..., None]],
    engine_processes: int | None = None,
    trainer_ranks: Sequence[int] | None = None,
    port: int = 0,
) -> list[WorldOutcome]:
    """Start the engine processes once, then each trainer world in turn (`trainer_ranks[i]`
    processes for `trainers[i]`, default `opts.trainers`), each against the same engines; stop
    the engines. A failed world does not stop the next one; engines that died fail every
    world after them. `opts.job_id` names the job; its rendezvous is at 127.0.0.1:`port` (0: a
    free port)."""
    from ..core.rendezvous import Rendezvous

    ctx = context()
    server = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id, is_server=True)
    stop = ctx.Event()
    count = opts.engines if engine_processes is None else engine_processes
    engines = [process(ctx, engine, (i, opts, server.port, stop), name=f"engine-{i}") for i in range(count)]
    for p in engines:
        p.start()
    outcomes = []
    try:
        for i, trainer in enumerate(trainers):
            ranks = opts.trainers if trainer_ranks is None else trainer_ranks[i]
            outcomes.append(_run_world(ctx, opts, server.port, engines, trainer, ranks, f"trainers{i}"))
    finally:
        stop.set()
        _stop(engines)
    failed = [f"{p.name} exited with {p.exitcode}" for p in engines if p.exitcode != 0]
    if failed:
        for outcome in outcomes:
            outcome.error = outcome.error or "engine processes failed: " + ", ".join(failed)
    return outcomes


def _run_world(
    ctx: Any, opts: Any, port: int, engines: list[Any], trainer: Callable[..., None], ranks: int, world: str
) -> WorldOutcome:
    results = ctx.Queue()
    procs = [process(ctx, trainer, (r, opts, port, results), name=f"{world}-rank{r}") for r in range(ranks)]
    for p in procs:
        p.start()
    outcome = WorldOutcome()
    try:
        while True:
            message = _next(results, procs + engines)
            if not isinstance(message, Part):
                outcome.value = message
                break
            outcome.parts.append(message.value)
    except RuntimeError as exc:
        outcome.error = str(exc)
    finally:
        _stop(procs)
    failed = [f"{p.name} exited with {p.exitcode}" for p in procs if p.exitcode != 0]
    if failed and not outcome.error:
        outcome.error = "processes failed: " + ", ".join(failed)
    return outcome


def _next(results: Any, processes: list[Any]) -> Any:
    """The next message of trainer rank 0; RuntimeError as soon as any of `processes` died."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(", ".join(f"{p.name} exited with {p.exitcode}" for p in dead)) from None


def _stop(processes: list[Any]) -> None:
    for p in processes:
        p.join(timeout=JOIN_TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def join_trainer_world(rank: int, opts: Any, port: int, *, world_size: int | None = None,
                       timeout: float | None = None) -> Rendezvous:
    """Join the trainer world (gloo on CPU, NCCL on CUDA) as `rank` through the launcher's rendezvous
    store (no second port) on `opts.device` (default cpu); return this rank's rendezvous (waiting
    `timeout` for engines, default its own). Worlds started one after another use fresh store keys."""
    import torch
    import torch.distributed as dist

    from ..core.devices import resolve
    from ..core.logs import configure
    from ..core.rendezvous import Rendezvous

    configure(f"trainer {rank}")
    torch.set_num_threads(1)
    placement = resolve(getattr(opts, "device", "cpu"))
    if placement.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id, **kwargs)
    size = opts.trainers if world_size is None else world_size
    worlds = rendezvous.add(f"worlds/{rank}")  # this rank's n-th world
    dist.init_process_group(
        placement.collective_backend, store=rendezvous.group_store(f"gloo/{worlds}"), rank=rank, world_size=size,
    )
    return rendezvous
