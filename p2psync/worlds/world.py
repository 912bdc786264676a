"""A world: engines started once, then every trainer kind and transport run against them.

Starting an engine world costs most of a round trip (sglang and vLLM ranks import and
build for a minute or more on a small machine), so one world serves every combination
that shares its engines: each trainer kind is a world of its own processes, started
after the previous one ended, and runs one transport after another; for each transport
the engines serve it, the trainer connects, trains and updates `updates` times, then
the engines and the trainer's independent oracle dump what they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.layout import ALIGN
from .engines import dump_path, engine_ids, engine_main
from .launch import launch_worlds
from .options import RunResult, WorldOptions, split_kind
from .trainers import trainer_main, version_label

if TYPE_CHECKING:
    import torch

Pairs = dict[str, tuple[dict[str, "torch.Tensor"], dict[str, "torch.Tensor"]]]


def unavailable(kind: str, name: str) -> str:
    """Why the registered `kind` ("transports", "trainer_sources", "engine_targets") `name`
    cannot run here, or ""."""
    from ..core.plugins import registry

    registration = registry().entries[kind].get(name)
    if registration is None:
        return f"no {kind.rstrip('s').replace('_', ' ')} named {name!r} is installed"
    usable, why = registration.dependency_status()
    return "" if usable else f"{kind.rstrip('s').replace('_', ' ')} {name} cannot import {why}"


def trainer_unavailable(kind: str) -> str:
    """Why the harness cannot run trainer kind `kind` here, or "". Megatron-Bridge's package does
    not import whole without Transformer Engine (a CUDA build); the harness loads its mapping
    modules alone (`megatron.bridge_deepseek_registry`, and its LoRA `megatron.bridge_peft_modules`),
    so it needs the package installed only."""
    import importlib.util

    kind = split_kind(kind)[0]
    if kind not in ("megatron-bridge", "megatron-bridge-lora"):
        return unavailable("trainer_sources", kind)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return "megatron-bridge is not installed (pip install --no-deps megatron-bridge==0.3.1; environment bridge)"
    return unavailable("trainer_sources", "megatron")


def run_world(opts: WorldOptions) -> dict[tuple[str, str], RunResult]:
    """Run the world; every run's result, keyed (trainer kind, transport). A trainer world that
    failed fails its runs that did not report, and (if it failed after them) the others too."""
    kinds = opts.trainer_kinds
    outcomes = launch_worlds(
        opts, engine_main, [partial(trainer_main, kind=k) for k in kinds],
        engine_processes=opts.engines * opts.engine_tp, trainer_ranks=[opts.ranks_of(k) for k in kinds],
        port=opts.rendezvous_port,
    )
    results: dict[tuple[str, str], RunResult] = {}
    for kind, outcome in zip(kinds, outcomes):
        done = {(r.trainer, r.transport): r for r in outcome.parts}
        for transport in opts.transports_of(kind):
            result = done.get((kind, transport)) or RunResult(kind, transport, error="did not run")
            if outcome.error:
                result.error = f"the {kind} trainer world failed: {outcome.error}" + (
                    f" ({result.error})" if result.error else ""
                )
            results[kind, transport] = result
    return results


class World:
    """A world run at most once, when a test first asks for one of its runs; the runs that
    cannot run here are skipped with the reason, without starting anything."""

    def __init__(self, opts: WorldOptions) -> None:
        if opts.dump_dir is None:
            raise ValueError("a world whose bytes are checked needs a dump_dir")
        self.opts = opts
        self.skipped = {run: self._why_not(*run) for run in opts.runs}
        self._results: dict[tuple[str, str], RunResult] | None = None

    def _why_not(self, kind: str, transport: str) -> str:
        return (
            unavailable("engine_targets", self.opts.engine)
            or trainer_unavailable(kind)
            or unavailable("transports", transport)
        )

    def result(self, kind: str, transport: str) -> RunResult:
        if self.skipped[kind, transport]:
            return RunResult(kind, transport, skipped=self.skipped[kind, transport])
        if self._results is None:
            runnable = tuple(run for run in self.opts.runs if not self.skipped[run])
            self._results = run_world(replace(self.opts, runs=runnable))
        return self._results[kind, transport]

    def round_trip(self, kind: str, transport: str) -> Callable[[], Pairs]:
        """The `RoundTripTests.round_trip` of one run: its reports checked, then per engine rank
        (`engine-0[1]`) what the engine's own loader makes of the oracle's tensors, and what the
        rank held."""

        def go() -> Pairs:
            import pytest

            result = self.result(kind, transport)
            if result.skipped:
                pytest.skip(result.skipped)
            if result.error:
                pytest.fail(f"{kind} -> {self.opts.engine} over {transport}: {result.error}", pytrace=False)
            check_reports(result, self.opts)
            way = split_kind(kind)[1]
            if way.startswith("gather-free"):
                free, gathered = result.gather_free_bytes  # the worlds' engines only copy: nothing to gather
                assert free > 0 and gathered == 0, (
                    f"{kind} -> {self.opts.engine}: {free} bytes sent gather-free, {gathered} gathered; "
                    f"{result.reports[0].degraded if result.reports else ''}"
                )
            else:
                assert result.buckets > 1, "the run must span several buckets"
            if way.endswith("delta"):
                check_deltas(result, self.opts, gather_free=way.startswith("gather-free"))
            return self.pairs(result)

        return go

    def pairs(self, result: RunResult) -> Pairs:
        dumps = held(self.opts, Path(result.folder))
        if self.opts.engine == "vllm":
            last = version_label(result.trainer, result.transport, self.opts.updates)
            for calls in (d["calls"] for d in dumps.values()):
                check_vllm_calls(calls, self.opts.updates, last)
        return pair_up(expected_bytes(self.opts, Path(result.folder)), dumps)


def held(opts: WorldOptions, folder: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """What each engine rank saved in `folder`: its parameters and the engine's own control calls."""
    import torch

    return {
        (engine, rank): torch.load(dump_path(folder, engine, rank))
        for engine in engine_ids(opts) for rank in range(opts.engine_tp)
    }


def expected_bytes(opts: WorldOptions, folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per engine rank, what the engine's own loader makes of the oracle tensors saved in `folder`."""
    import torch

    oracle = torch.load(folder / "oracle.pt")
    return {rank: loaded(opts, rank, oracle) for rank in range(opts.engine_tp)}


def pair_up(expected: Mapping[int, dict[str, torch.Tensor]], dumps: Mapping[tuple[str, int], dict[str, Any]]) -> Pairs:
    """`RoundTripTests`' results: per engine rank (`engine-0[1]`), expected and held tensors."""
    return {f"{engine}[{rank}]": (expected[rank], dump["params"]) for (engine, rank), dump in dumps.items()}


def loaded(opts: WorldOptions, rank: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bytes the world's engine kind holds on `rank` after its own loader read `tensors`."""
    from . import oracles

    if opts.engine == "torch":
        return oracles.torch_loaded(opts.model, opts.engine_dtype, tensors)
    if opts.engine == "sglang":
        rank_model = oracles.sglang_loaded(opts.model.config_dict(), opts.engine_tp, 1, rank, tensors)
        return {name: p.data for name, p in rank_model.model.named_parameters()}
    from ..adapters.vllm import shim

    config = shim.engine_config(opts.model.config_dict(), tp=opts.engine_tp, dtype=opts.engine_dtype)
    return {name: p.data for name, p in oracles.vllm_loaded(config, rank, tensors).named_parameters()}


def check_reports(result: RunResult, opts: WorldOptions) -> None:
    """Every update of the run reached every engine, digest-checked; engines that generate
    continue the prompt as the trainer does after every update."""
    assert len(result.reports) == opts.updates, result
    for report in result.reports:
        assert report.ok, report.format()
        assert all(e.bytes > 0 and e.checked == opts.session.check for e in report.engines.values()), report.format()
        assert set(report.engines) == set(engine_ids(opts)), report.format()
    assert not result.meaning, result.meaning
    for generations in result.generations:
        assert generations == dict.fromkeys(["trainer", *engine_ids(opts)], generations["trainer"]), generations


def check_deltas(result: RunResult, opts: WorldOptions, gather_free: bool) -> None:
    """The first update is full; every later one a delta to every rank. Gather-free, every
    rank's own shards went as deltas too, and rank 0's baselines hold its own bytes (what it
    produces in one update, slots aligned), not a full group's."""
    for report in result.reports[1:]:
        deltas = {e: sorted(r.delta_ranks) for e, r in report.engines.items()}
        assert all(ranks == list(range(opts.engine_tp)) for ranks in deltas.values()), deltas
        if gather_free:
            assert not any("sent in full" in note for note in report.degraded), report.degraded
            assert 0 < report.changed_elements <= report.compared_elements, report.format()  # AdamW: most change
    memory = result.delta_memory
    if gather_free and memory is not None:
        assert memory.produced_bytes <= memory.baseline_bytes, memory
        assert memory.baseline_bytes <= memory.produced_bytes + 2 * ALIGN * memory.params, memory
        full = result.reports[0].engines[engine_ids(opts)[0]].bytes  # what every sender wrote to one engine
        assert memory.baseline_bytes < full, (memory, full)


def check_vllm_calls(calls: list[list[Any]], updates: int, version: str) -> None:
    """Driven through vLLM's own weight-transfer flow, in its order, every update."""
    names = [c[0] for c in calls]
    assert names == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights",
                                                       "finish_weight_update"] * updates, names
    assert calls[-2][1] == {"update_info": {"version": version}}, calls[-2]
