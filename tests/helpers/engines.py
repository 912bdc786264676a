"""Engines in their own processes and a trainer in the test process, for fault tests.

A small torch model serves as both the trainer's model and each engine's; the
trainer is one process without torch.distributed (FSDP2Source on an unsharded
module), so tests drive `Session` directly and cheaply.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from p2psync.core.rendezvous import Rendezvous
from p2psync.core.transport import Transport
from p2psync.worlds.netbox import Box, join
from p2psync.worlds.processes import context, process

#: Where an engine process runs in a cluster in a box: the box, its node and slot there.
Place = tuple[Box, int, int]


def small_model(seed: int, width: int = 32) -> torch.nn.Module:
    """A few differently shaped parameters, random per seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, width),
        torch.nn.Linear(width, 2 * width),
        torch.nn.LayerNorm(2 * width),
        torch.nn.Linear(2 * width, 16, bias=False),
    )


T = TypeVar("T")


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One real optimizer step on `small_model`: cross-entropy of random tokens' logits."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (32,), generator=generator)
    labels = torch.randint(0, 16, (32,), generator=generator)
    torch.nn.functional.cross_entropy(model(tokens), labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """The first truthy value of `predicate`, polled until `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout} s")
        time.sleep(0.1)


class RecordingTransport(Transport):
    """Records what an engine exposes and registers nothing: for endpoints in the test process
    that only answer control calls (it never writes)."""

    name = "mooncake"
    exposed: list[tuple[int, int]]

    def expose(self, tensors):
        self.exposed = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        return {"session": "127.0.0.1:1"}

    def register_buffer(self, buffer):
        raise AssertionError("engines register no buffers")

    def unregister_buffer(self, buffer):
        raise AssertionError("engines register no buffers")

    def open(self, table):
        raise AssertionError("engines open no peers")

    def close(self):
        pass


def engine_process(
    engine_id: str, port: int, job_id: str, transport: str, seed: int, width: int, dtype: str, stop: Any,
    place: Place | None = None, options: dict[str, Any] | None = None,
) -> None:
    """A torch engine serving `small_model` (in `dtype`) until `stop` is set, joined to
    `place` of a cluster in a box first where given, with endpoint `options` (`EndpointOptions`:
    `transport_options`, `verify_seconds`, ...) besides its hooks. Besides the endpoint's routes: `state`
    returns every parameter's bytes (hex), read by tests as the engine holds them; `poke`
    flips the bits of one byte of parameter `name` (a stray write); `reload` loads another
    seed's weights by the module's `load_state_dict`."""
    if place is not None:
        join(*place)
    from p2psync.adapters.torch import serve
    from p2psync.engine.endpoint import EngineHooks
    from p2psync.core.logs import configure

    configure(f"{engine_id} rank 0")
    torch.set_num_threads(1)
    model = small_model(seed, width).to(getattr(torch, dtype))
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=job_id, patient=True)  # engines outlive trainers
    params = dict(model.named_parameters())

    def raw(name: str) -> torch.Tensor:
        return params[name].data.reshape(-1).view(torch.uint8)

    def poke(body: dict[str, Any]) -> None:
        raw(body["name"])[int(body.get("byte", 0))] ^= 0xFF

    def reload(body: dict[str, Any]) -> None:
        model.load_state_dict(small_model(seed + 7, width).to(getattr(torch, dtype)).state_dict())

    routes = {
        "state": lambda body: {n: raw(n).numpy().tobytes().hex() for n in params}, "poke": poke, "reload": reload,
    }
    endpoint = serve(
        model, engine_id=engine_id, rendezvous=rendezvous, transport=transport, hooks=EngineHooks(routes=routes),
        **(options or {}),
    )
    stop.wait()
    endpoint.close()


@dataclass
class Engines:
    """Engine processes of one job (each at its place in a cluster in a box where `places`
    names one, each endpoint with `options`); killed at the end of the `engines` context."""

    rendezvous: Rendezvous
    transport: str
    width: int = 32
    places: dict[str, Place] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    procs: dict[str, Any] = field(default_factory=dict)
    stops: dict[str, Any] = field(default_factory=dict)

    def start(self, engine_id: str, seed: int = 1, width: int | None = None, dtype: str = "float32") -> None:
        ctx = context()
        stop = ctx.Event()
        args = (
            engine_id, self.rendezvous.port, self.rendezvous.job_id, self.transport, seed, width or self.width,
            dtype, stop, self.places.get(engine_id), self.options,
        )
        proc = process(ctx, engine_process, args, name=engine_id, daemon=True)
        proc.start()
        self.procs[engine_id], self.stops[engine_id] = proc, stop

    def pid(self, engine_id: str) -> int:
        return self.procs[engine_id].pid

    def kill(self, engine_id: str) -> None:
        os.kill(self.pid(engine_id), signal.SIGKILL)
        self.procs[engine_id].join(10)

    def freeze(self, engine_id: str) -> None:
        os.kill(self.pid(engine_id), signal.SIGSTOP)

    def thaw(self, engine_id: str) -> None:
        os.kill(self.pid(engine_id), signal.SIGCONT)

    def stop(self, engine_id: str) -> None:
        proc = self.procs.pop(engine_id)
        self.stops.pop(engine_id).set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    def close(self) -> None:
        for engine_id, proc in self.procs.items():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                self.stops[engine_id].set()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()


@contextmanager
def engines(
    transport: str = "mooncake", job_id: str = "test", width: int = 32, places: dict[str, Place] | None = None,
    options: dict[str, Any] | None = None,
) -> Iterator[Engines]:
    """A rendezvous hosted by the test process and a set of engine processes (endpoint `options`)."""
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id=job_id, is_server=True, timeout=30)
    group = Engines(rendezvous, transport, width, places or {}, options or {})
    try:
        yield group
    finally:
        group.close()
