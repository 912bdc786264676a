"""Engine-rank processes of a world: one per rank, built once, serving one transport at a time.

Besides its p2psync endpoint, each rank serves the harness's own control routes (keyed
`harness/<engine>/<rank>` in the rendezvous): `serve` (re-serve over another transport),
`reset` (stop serving), `dump` (save what the rank holds), `generate` (greedy decoding, where
the engine generates on CPU) and, for vLLM, the four calls of vLLM's weight-transfer flow, as
a vLLM worker's RPCs would reach it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .oracles import SGLANG_FILL, vllm_loaded
from .models import greedy

if TYPE_CHECKING:
    import torch

    from ..core.control import ControlServer
    from ..engine.endpoint import EngineEndpoint
    from ..core.rendezvous import Rendezvous
    from .options import WorldOptions

Route = Callable[[dict[str, Any]], dict[str, Any]]

#: vLLM's worker-side weight-transfer calls, in the order its engine core makes them.
VLLM_ROUTES = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def engine_ids(opts: WorldOptions) -> list[str]:
    return [f"engine-{i}" for i in range(opts.engines)]


def member(opts: WorldOptions, index: int) -> tuple[str, int]:
    """Engine id and rank of engine-rank process `index`."""
    return engine_ids(opts)[index // opts.engine_tp], index % opts.engine_tp


def harness_key(engine_id: str, rank: int) -> str:
    return f"harness/{engine_id}/{rank}"


class EngineRank:
    """One engine rank in its process: its live parameters and how it serves them."""

    def __init__(self, engine_id: str, rank: int, rendezvous: Rendezvous, params: dict[str, torch.Tensor]) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.rendezvous = rendezvous
        self.params = params
        self.endpoint: EngineEndpoint | None = None
        self.server: ControlServer | None = None  # the harness routes
        self.calls: list[list[Any]] = []  # the engine's own control calls since the last reset

    def make_endpoint(self, transport: str) -> EngineEndpoint:
        raise NotImplementedError

    def serve(self, transport: str) -> EngineEndpoint:
        """Serve over `transport`, closing the endpoint of another transport first."""
        if self.endpoint is not None and self.endpoint.transport.name == transport:
            return self.endpoint
        self.reset()
        self.endpoint = self.make_endpoint(transport)
        return self.endpoint

    def reset(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.calls = []

    def dump(self, path: str) -> None:
        import torch

        held = {name: t.clone() for name, t in self.params.items()}
        torch.save({"params": held, "calls": self.calls}, path)

    def routes(self) -> dict[str, Route]:
        def reset(body: dict[str, Any]) -> dict[str, Any]:
            self.reset()
            return {}

        def dump(body: dict[str, Any]) -> dict[str, Any]:
            self.dump(body["path"])
            return {}

        return {
            "serve": lambda body: {"transport": self.serve(body["transport"]).transport.name},
            "reset": reset,
            "dump": dump,
        }

    def close(self) -> None:
        self.reset()
        if self.server is not None:
            self.server.close()
            self.server = None


class TorchRank(EngineRank):
    """A transformers model of the world's architecture, served by the torch engine adapter."""

    def __init__(self, engine_id: str, rank: int, rendezvous: Rendezvous, opts: WorldOptions, seed: int) -> None:
        import torch

        from ..core.devices import resolve

        self.model = opts.model.build(seed).to(getattr(torch, opts.engine_dtype)).to(resolve(opts.device).device)
        super().__init__(engine_id, rank, rendezvous, {n: p.data for n, p in self.model.named_parameters()})

    def make_endpoint(self, transport: str) -> EngineEndpoint:
        from ..adapters.torch import serve

        return serve(self.model, engine_id=self.engine_id, rendezvous=self.rendezvous, transport=transport)

    def routes(self) -> dict[str, Route]:
        return {**super().routes(), "generate": lambda body: {"tokens": greedy(self.model, int(body.get("tokens", 8)))}}


class SglangRank(EngineRank):
    """sglang's model of one TP rank on CPU (bfloat16), parameters prefilled with `SGLANG_FILL`."""

    def __init__(self, engine_id: str, rank: int, rendezvous: Rendezvous, opts: WorldOptions) -> None:
        import torch

        from ..adapters.sglang.shim import RankSpec, build_rank_model

        spec = RankSpec(opts.model.config_dict(), opts.engine_tp, 1, opts.engine_dtype, rank)
        self.rank_model = build_rank_model(spec, "cpu")
        for p in self.rank_model.model.parameters():
            p.data.view(-1).view(torch.uint8).fill_(SGLANG_FILL)
        super().__init__(engine_id, rank, rendezvous, {n: p.data for n, p in self.rank_model.model.named_parameters()})

    def make_endpoint(self, transport: str) -> EngineEndpoint:
        from ..adapters.sglang import serve

        m = self.rank_model
        return serve(m.model, m.server_args, m.model_config, engine_id=self.engine_id, rank=self.rank,
                     rendezvous=self.rendezvous, transport=transport)


class VllmRank(EngineRank):
    """vLLM's model of one TP rank on CPU, loaded by vLLM with weights of its own, updated only
    through vLLM's weight-transfer flow with the `p2psync` backend (its trainer chooses the
    transport at `init_weight_transfer_engine`)."""

    def __init__(self, engine_id: str, rank: int, rendezvous: Rendezvous, opts: WorldOptions, seed: int) -> None:
        import torch

        from ..adapters.vllm import shim

        shim.import_vllm()  # before any vLLM module: it selects the CPU platform
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from ..adapters.vllm import vllm_plugin

        self.config = shim.engine_config(opts.model.config_dict(), tp=opts.engine_tp, dtype=opts.engine_dtype)
        self._state = ExitStack()
        self._state.enter_context(shim.rank_state(self.config, rank))  # a vLLM worker's parallel state, for life
        model = vllm_loaded(self.config, rank, opts.model.build(seed).state_dict())
        vllm_plugin.register()
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="p2psync"), self.config, torch.device("cpu"), model
        )
        super().__init__(engine_id, rank, rendezvous, {n: p.data for n, p in model.named_parameters()})

    def reset(self) -> None:
        self.engine.shutdown()
        self.calls = []

    def _call(self, name: str) -> Route:
        def call(body: dict[str, Any]) -> dict[str, Any]:
            self.calls.append([name, body])
            if name == "init_weight_transfer_engine":
                self.engine.init_transfer_engine(self.engine.parse_init_info(body["init_info"]))
            elif name == "update_weights":
                self.engine.update_weights(body["update_info"])
            else:
                getattr(self.engine, name)()
            return {}

        return call

    def routes(self) -> dict[str, Route]:
        routes = super().routes()
        del routes["serve"]  # the trainer's init call serves
        return {**routes, **{name: self._call(name) for name in VLLM_ROUTES}}

    def close(self) -> None:
        super().close()
        self._state.close()


def start_engine(index: int, opts: WorldOptions, port: int) -> EngineRank:
    """Build engine-rank process `index` of the world, serve the world's first transport (not
    vLLM: its trainer's init does) and the harness routes; return the rank."""
    import torch

    from ..core.control import ControlServer
    from ..core.logs import configure
    from ..core.rendezvous import Rendezvous

    engine_id, rank = member(opts, index)
    configure(f"{engine_id} rank {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id)
    seed = 1000 + index // opts.engine_tp  # weights of its own, unlike the trainer's
    if opts.engine == "torch":
        engine: EngineRank = TorchRank(engine_id, rank, rendezvous, opts, seed)
    elif opts.engine == "sglang":
        engine = SglangRank(engine_id, rank, rendezvous, opts)
    elif opts.engine == "vllm":
        engine = VllmRank(engine_id, rank, rendezvous, opts, seed)
    else:
        raise ValueError(f"no world engine kind {opts.engine!r}")
    if opts.engine != "vllm":
        engine.serve(opts.transports[0])
    engine.server = ControlServer(engine.routes(), token=rendezvous.token())
    rendezvous.set(harness_key(engine_id, rank), engine.server.url)
    return engine


def engine_main(index: int, opts: WorldOptions, port: int, stop: Any) -> None:
    """Engine-rank process `index`: serve until `stop` is set."""
    engine = start_engine(index, opts, port)
    stop.wait()
    engine.close()
    if opts.engine == "vllm":
        # Interpreter teardown of a process holding vLLM and Mooncake hangs in native code
        # (seen: >30 s, no Python frame); everything is closed, so end the process here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def dump_path(folder: str | Path, engine_id: str, rank: int) -> Path:
    return Path(folder) / f"{engine_id}-rank{rank}.pt"
