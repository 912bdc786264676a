"""Base test classes. Subclass one, provide its fixture, and pytest runs its tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ..core.devices import DEVICES, why_no_cuda
from ..core.errors import ConnectError, TransferError
from ..core.layout import Layout
from ..core.source import TrainerSource
from ..core.transport import Transport, WriteBatch
from ..core.types import ParamSpec, TargetParam, TargetTable

#: Upper bound on how far past its timeout a failing write may return.
TIMEOUT_MARGIN = 5.0

#: What `RoundTripTests.round_trip` provides: a run returning, per engine rank, (what the engine's
#: own loader produces from the trainer's last weights, what the rank holds).
RoundTrip = Callable[[], dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]]


def require_device(device: str, transport: type[Transport] | Transport | None = None) -> None:
    """Skip, with the reason, a variant this machine or this transport cannot run."""
    if device == "cuda" and (reason := why_no_cuda()):
        pytest.skip(reason)
    if transport is not None and device not in transport.devices:
        pytest.skip(f"transport {transport.name} does not write {device} memory")


def table_for(transport: Transport, tensors: Mapping[str, torch.Tensor], info: dict[str, Any]) -> TargetTable:
    """A target table for `tensors` exposed through `transport`."""
    return TargetTable(
        engine_id="conformance", rank=0, world_size=1, engine="torch", layout_key={}, transport=transport.name,
        transport_info=info, control_url="", job_id="conformance",
        params=tuple(
            TargetParam(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.data_ptr(), t.numel() * t.element_size())
            for n, t in tensors.items()
        ),
    )


class TransportTests:
    """Every transport: bytes land exactly where they are written, and a lost peer
    fails within the timeout. Provide `make_transport` (a factory of new instances
    of the transport under test); engine and trainer sides run in this process."""

    @pytest.fixture
    def make_transport(self) -> Callable[[], Transport]:
        raise NotImplementedError("subclasses provide make_transport")

    @pytest.fixture(params=DEVICES)
    def device(self, request: pytest.FixtureRequest) -> str:
        """Where the engine's memory lives: every transport on CPU, and on CUDA where
        the transport declares it and CUDA is present (the GPU variants)."""
        require_device(request.param)
        return request.param

    @pytest.fixture
    def pair(self, make_transport: Callable[[], Transport], device: str) -> Iterator[tuple[Transport, Transport]]:
        from ..core.rendezvous import Rendezvous

        require_device(device, make_transport())
        rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="conformance", is_server=True, timeout=10)
        engine, trainer = make_transport(), make_transport()
        engine.bind(rendezvous)
        trainer.bind(rendezvous)
        yield engine, trainer
        trainer.close()
        engine.close()

    def test_writes_land_bit_for_bit(self, pair: tuple[Transport, Transport], device: str) -> None:
        engine, trainer = pair
        params = {
            "a": torch.zeros(1000, dtype=torch.float32, device=device),
            "b": torch.zeros(3, 7, dtype=torch.bfloat16, device=device),
        }
        table = table_for(engine, params, engine.expose(list(params.values())))
        buffer = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory() if device == "cuda" else (
            torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        )
        trainer.register_buffer(buffer)
        peer = trainer.open(table)
        batch = WriteBatch()
        batch.add(buffer.data_ptr() + 64, params["a"].data_ptr(), 4000)
        batch.add(buffer.data_ptr() + 8192, params["b"].data_ptr() + 2, 40)  # a region inside a parameter
        peer.write(batch, timeout=30)
        assert torch.equal(params["a"].cpu().view(torch.uint8), buffer[64:4064])
        b = params["b"].cpu().view(torch.uint8).reshape(-1)
        assert torch.equal(b[2:42], buffer[8192:8232])
        assert not b[:2].any() and not b[42:].any(), "bytes outside the written region changed"
        peer.close()
        trainer.unregister_buffer(buffer)

    def test_write_to_a_closed_peer_fails_in_time(self, pair: tuple[Transport, Transport], device: str) -> None:
        engine, trainer = pair
        params = {"a": torch.zeros(256, device=device)}
        table = table_for(engine, params, engine.expose(list(params.values())))
        buffer = torch.ones(1 << 12, dtype=torch.uint8)
        trainer.register_buffer(buffer)
        peer = trainer.open(table)
        engine.close()
        batch = WriteBatch()
        batch.add(buffer.data_ptr(), params["a"].data_ptr(), 1024)
        start = time.monotonic()
        with pytest.raises(TransferError):
            peer.write(batch, timeout=2)
        assert time.monotonic() - start < 2 + TIMEOUT_MARGIN


@dataclass
class EngineCase:
    """A target table, the trainer's HF tensors, the bytes that rank held before its loader
    ran (`initial`) and the bytes the engine's own loader produced on that rank from the
    tensors (`expected`), parameter name -> tensor. Where the loader leaves a region alone
    (padding), `expected` holds the initial bytes there: pick initial bytes that no correct
    load produces (e.g. 0xA5 everywhere), so that a layout writing there shows."""

    table: TargetTable
    sources: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    layout: Callable[[TargetTable, Mapping[str, ParamSpec]], Layout]


def row_shards(tensors: Mapping[str, torch.Tensor], world: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    """The flat element ranges of each tensor that rank `rank` of `world` holds when every tensor
    is split by rows as FSDP2 shards it (`torch.chunk`: ceil(rows / world) rows each)."""
    held = {}
    for name, t in tensors.items():
        chunk = -(-t.shape[0] // world) if t.dim() else 1
        per_row = t[0].numel() if t.dim() > 1 else 1
        rows = t.shape[0] if t.dim() else 1
        first, last = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        held[name] = [(first * per_row, last * per_row)] if last > first else []
    return held


def specs_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, ParamSpec]:
    return {n: ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_layout_reproduces_the_loader(case: EngineCase) -> None:
    """Every byte of every parameter of the rank, after the layout's writes land on the rank's
    initial bytes, equals what the engine's own loader left there (regions the layout does
    not write must hold what the loader left too, i.e. the loader left them alone)."""
    layout = case.layout(case.table, specs_of(case.sources))
    params = {p.name: p for p in case.table.params}
    assert set(case.expected) == set(params), "the case's expected bytes must name every parameter of the table"
    held = {n: as_bytes(case.initial[n]).clone() for n in params}
    for name, p in params.items():
        assert held[name].numel() == p.nbytes, f"{name}: initial bytes are not the parameter's size"
    for group in layout.groups():
        out = torch.zeros(group.nbytes, dtype=torch.uint8)
        for r in layout.fill(group, case.sources, out):
            assert 0 <= r.param_offset and r.param_offset + r.nbytes <= params[r.param].nbytes, r
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = out[r.buffer_offset : r.buffer_offset + r.nbytes]
    for name in params:
        want = as_bytes(case.expected[name])
        differ = (held[name] != want).nonzero()
        assert differ.numel() == 0, (
            f"{case.table.engine_id} rank {case.table.rank} parameter {name!r}: {differ.numel()} of {want.numel()} "
            f"bytes differ from the engine's own loader, the first at byte {differ[0].item()}"
        )


class EngineTargetTests:
    """Every engine target: its layout reproduces, bit for bit, what the engine's own
    loader writes on that rank. Provide `engine_case` (an EngineCase)."""

    @pytest.fixture
    def engine_case(self) -> EngineCase:
        raise NotImplementedError("subclasses provide engine_case")

    def test_groups_cover_every_parameter_once(self, engine_case: EngineCase) -> None:
        layout = engine_case.layout(engine_case.table, specs_of(engine_case.sources))
        outputs = [name for g in layout.groups() for name in g.outputs]
        assert sorted([*outputs, *layout.left_alone()]) == sorted(p.name for p in engine_case.table.params)
        for group in layout.groups():
            assert set(group.inputs) <= set(engine_case.sources), group

    def test_layout_bytes_equal_the_engine_loader(self, engine_case: EngineCase) -> None:
        assert_layout_reproduces_the_loader(engine_case)

    @pytest.mark.parametrize("world", [2, 3])
    def test_each_trainer_shard_writes_its_own_part_without_a_gather(self, engine_case: EngineCase, world: int) -> None:
        """Gather-free: with every HF tensor split by rows over `world` trainer ranks (as FSDP2
        shards), each rank's `copy_runs`, the constants and the groups that must be gathered
        write exactly the regions the layout writes, and, landed on the rank's initial bytes,
        leave every byte the engine's loader leaves."""
        layout = engine_case.layout(engine_case.table, specs_of(engine_case.sources))
        params = {p.name: p for p in engine_case.table.params}
        held = {n: as_bytes(engine_case.initial[n]).clone() for n in params}
        wrote = {n: torch.zeros(p.nbytes, dtype=torch.bool) for n, p in params.items()}
        loader = {n: torch.zeros(p.nbytes, dtype=torch.bool) for n, p in params.items()}

        def put(name: str, start: int, data: torch.Tensor) -> None:
            assert not wrote[name][start : start + data.numel()].any(), f"{name}: bytes at {start} written twice"
            held[name][start : start + data.numel()] = data
            wrote[name][start : start + data.numel()] = True

        for group in layout.groups():
            out = torch.zeros(group.nbytes, dtype=torch.uint8)
            regions = layout.fill(group, engine_case.sources, out)
            for r in regions:
                loader[r.param][r.param_offset : r.param_offset + r.nbytes] = True
            if layout.copy_runs(group, {}) is None:  # not copies: gathered, as before
                for r in regions:
                    put(r.param, r.param_offset, out[r.buffer_offset : r.buffer_offset + r.nbytes])
                continue
            out.zero_()
            for r in layout.fill_constants(group, out):
                put(r.param, r.param_offset, out[r.buffer_offset : r.buffer_offset + r.nbytes])
            for rank in range(world):
                runs = layout.copy_runs(group, row_shards(engine_case.sources, world, rank))
                assert runs is not None, "a layout of copies must say every rank's copies"
                for run in runs:
                    dtype = getattr(torch, params[run.param].dtype)
                    src = engine_case.sources[run.source].reshape(-1)[run.source_offset : run.source_offset + run.numel]
                    size = dtype.itemsize
                    put(run.param, run.param_offset * size, src.to(dtype).view(torch.uint8))
        for name in params:
            assert torch.equal(wrote[name], loader[name]), f"{name}: gather-free writes other regions than the layout"
            same = torch.equal(held[name], as_bytes(engine_case.expected[name]))
            assert same, f"{name}: gather-free bytes differ from the engine's loader"

    def test_a_shape_the_trainer_does_not_have_is_refused(self, engine_case: EngineCase) -> None:
        name, tensor = next(iter(engine_case.sources.items()))
        wrong = dict(specs_of(engine_case.sources))
        wrong[name] = ParamSpec(name, (*tensor.shape[:-1], tensor.shape[-1] + 1), wrong[name].dtype)
        with pytest.raises(ConnectError, match="engine '.*' rank"):
            engine_case.layout(engine_case.table, wrong)


@dataclass
class SourceCase:
    """A trainer source and the HF tensors it must yield."""

    source: TrainerSource
    expected: dict[str, torch.Tensor]


class TrainerSourceTests:
    """Every trainer source: HF names, shapes and full tensors as the HF model has them.
    Provide `source_case` (a SourceCase)."""

    @pytest.fixture
    def source_case(self) -> SourceCase:
        raise NotImplementedError("subclasses provide source_case")

    def test_specs_name_every_hf_tensor(self, source_case: SourceCase) -> None:
        specs = {s.name: s for s in source_case.source.param_specs()}
        assert set(specs) == set(source_case.expected)
        for name, tensor in source_case.expected.items():
            assert specs[name].shape == tuple(tensor.shape), name
            assert specs[name].dtype == str(tensor.dtype).removeprefix("torch."), name

    def test_gather_yields_the_full_tensors(self, source_case: SourceCase) -> None:
        names = sorted(source_case.expected)
        got = source_case.source.gather(names)
        for name in names:
            assert torch.equal(got[name], source_case.expected[name]), name

    def test_sender_group_contains_this_rank(self, source_case: SourceCase) -> None:
        group = source_case.source.sender_group()
        assert group.rank in group.ranks


class RoundTripTests:
    """trainer x engine x transport end to end. Provide `round_trip`: a callable that
    runs updates and returns, per engine rank, the tensors the engine's own loader
    produces from the trainer's last weights and the tensors the engine holds; they
    must be equal bit for bit."""

    @pytest.fixture
    def round_trip(self) -> RoundTrip:
        raise NotImplementedError("subclasses provide round_trip")

    def test_every_engine_holds_the_expected_bytes(self, round_trip: RoundTrip) -> None:
        assert_engines_hold(round_trip())


def assert_engines_hold(results: Mapping[str, tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]) -> None:
    """Per engine rank, the held tensors are the expected ones: same names, dtypes and every byte."""
    assert results, "no engine reported its weights"
    for engine, (expected, held) in results.items():
        assert held.keys() == expected.keys(), engine
        for name, tensor in expected.items():
            assert held[name].dtype == tensor.dtype, (engine, name)
            same = torch.equal(as_bytes(held[name]), as_bytes(tensor))
            assert same, f"{engine} parameter {name!r}: bytes differ from the engine's own loader's"
