"""Adding an engine (docs/architecture.md, "Add an engine"): a third engine kind, built here
from a plain torch model class, supplies only a rank-model builder (`ToyTarget.rank_model`)
and an endpoint (`serve_toy`); the shared layout room gives it copy maps, the per-parameter
fallback to its own loader, and bytes equal to its own `load_weights` on every rank.

The toy engine (tests/helpers/toy_engine.py) does what real engines do to a checkpoint: it fuses q, k and v into one
tensor-parallel `qkv`, splits `o` by columns, pads and splits the vocabulary by rows
(zeros in the padding), ties the LM head to the embedding, and stores each norm as
`1 + weight` (as Gemma's engines do: not a copy, so its own loader produces it). Delta
updates reach such an engine's regions (parts of parameters, at offsets) just as well.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from p2psync.conformance import EngineCase, EngineTargetTests
from p2psync.conformance.base import row_shards, specs_of
from p2psync.trainer.gatherfree import compile_packing
from p2psync.layouts.layout import EngineLayout
from tests.helpers.toy_engine import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    ShardSource,
    ToyEngineModel,
    ToyTarget,
    engine_rank,
    hf_model,
    toy_session,
)


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 3)])
class TestToyEngine(EngineTargetTests):
    conformance = {"engine": "toy"}

    @pytest.fixture
    def engine_case(self, tp, rank):
        sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
        engine, expected, table = engine_rank(tp, rank, sources)
        initial = {n: p.data.clone() for n, p in engine.named_parameters()}  # 0xA5: the loader's padding keeps it
        return EngineCase(table, sources, initial, expected, ToyTarget().layout)


def test_the_shared_room_gives_copy_maps_and_falls_back_per_parameter():
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    _, _, table = engine_rank(2, 1, sources)
    specs = specs_of(sources)
    layout = ToyTarget().layout(table, specs)
    assert isinstance(layout, EngineLayout)
    assert layout.loader_params == [f"layers.{i}.norm" for i in range(LAYERS)], "1 + w is not a copy"
    assert layout.rank_model is not None
    groups = {g.outputs: g.inputs for g in layout.groups()}
    assert groups[("layers.0.qkv",)] == ("layers.0.q.weight", "layers.0.k.weight", "layers.0.v.weight")
    assert layout.copy_dtype(next(g for g in layout.groups() if g.outputs == ("layers.0.qkv",))) == "float32"
    norm = next(g for g in layout.groups() if g.outputs == ("layers.0.norm",))
    assert layout.copy_dtype(norm) is None
    replica = ToyTarget(layout="replica").layout(table, specs)
    assert len(replica.loader_params) == len(table.params)


def state_of(trainer: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.state_dict().items()}


def assert_own_load(engines: list[ToyEngineModel], sources: dict[str, torch.Tensor], when: object) -> None:
    """Every rank holds exactly what its own loader makes of the trainer's tensors `sources`."""
    for rank, engine in enumerate(engines):
        expected = engine_rank(len(engines), rank, sources)[1]
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.view(torch.uint8), expected[name].view(torch.uint8)), (when, rank, name)


def test_a_session_updates_toy_engines_bit_exact_with_their_own_loader():
    from p2psync.adapters.fsdp2 import FSDP2Source

    trainer = hf_model(1)
    with toy_session(FSDP2Source(trainer)) as (session, engines):
        report = session.update("v1")
        assert report.ok, report.format()
    assert_own_load(engines, state_of(trainer), "v1")


def touch_a_few(trainer: nn.Module, step: int) -> None:
    """Change about 1% of every tensor's elements, as a small optimizer step does to bf16 bytes."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in trainer.parameters():
            pick = torch.rand(p.shape, generator=generator) < 0.01
            p[pick] += 0.5


@pytest.mark.parametrize("gather", ["always", "auto"])
def test_delta_updates_keep_toy_engines_bit_exact_with_their_own_loader(gather):
    """After its first (full) update each rank gets deltas: the regions a copy map writes
    (parts of a parameter, at offsets), the loader's own parameters and the untouched
    padding must all end as the rank's own loader leaves them. With gather="auto" the
    gather-free groups (all but the norms) are sent whole to the delta targets too, and the
    gathered norms (too small for a patch) dense where they changed."""
    from p2psync.adapters.fsdp2 import FSDP2Source

    trainer = hf_model(1)
    live = {n: t.detach() for n, t in trainer.state_dict().items()}  # the trainer's own storage
    source = FSDP2Source(trainer) if gather == "always" else ShardSource(live)
    with toy_session(source, delta=True, bucket_bytes=4096, gather=gather) as (session, engines):
        full_bytes = 0
        for step in range(4):
            if step:
                touch_a_few(trainer, step)
            report = session.update(f"v{step}")
            assert report.ok, report.format()
            assert report.engines["toy-0"].delta_ranks == ([0, 1] if step else [])
            if step == 0:
                full_bytes = report.engines["toy-0"].bytes
            elif gather == "always":
                assert report.engines["toy-0"].bytes < full_bytes / 2, report.format()
            assert_own_load(engines, state_of(trainer), step)


def test_a_rank_holding_nothing_of_a_tensor_has_no_runs_for_it():
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    _, _, table = engine_rank(2, 0, sources)
    layout = ToyTarget().layout(table, specs_of(sources))
    (qkv,) = [g for g in layout.groups() if g.outputs == ("layers.0.qkv",)]
    only_k = {"layers.0.k.weight": [(0, sources["layers.0.k.weight"].numel())]}
    runs = layout.copy_runs(qkv, only_k)
    rows = HEADS // 2 * HEAD_DIM
    # rank 0 holds k's first `rows` rows, contiguous in the middle third of its qkv: one run
    assert [(r.source, r.param_offset, r.source_offset, r.numel) for r in runs] == [
        ("layers.0.k.weight", rows * HIDDEN, 0, rows * HIDDEN)
    ]


# -- gather-free: the shared room's copy maps give a new engine gather-free sends too --------


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("tp", "rank"), [(2, 0), (4, 3)])
def test_every_trainer_ranks_packings_rebuild_the_loaders_bytes(world, tp, rank):
    """What the session sends gather-free: each of `world` trainer ranks, holding its rows of
    every HF tensor (as FSDP2 shards them), packs its runs (`compile_packing`, then `fill`
    from its local data); rank 0 adds the constants; the groups that are not copies are
    filled from gathered tensors. Landed on the rank's initial bytes, every byte equals the
    toy's own loader's, and no byte is written twice."""
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    engine, expected, table = engine_rank(tp, rank, sources)
    layout = ToyTarget().layout(table, specs_of(sources))
    params = {p.name: p for p in table.params}
    held = {n: p.data.view(-1).view(torch.uint8).clone() for n, p in engine.named_parameters()}
    written = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in held.items()}

    def land(regions, out):
        for r in regions:
            assert not written[r.param][r.param_offset : r.param_offset + r.nbytes].any(), f"{r.param} written twice"
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = out[r.buffer_offset : r.buffer_offset + r.nbytes]
            written[r.param][r.param_offset : r.param_offset + r.nbytes] = True

    copies = [g for g in layout.groups() if layout.copy_runs(g, {}) is not None]
    assert copies and len(copies) < len(layout.groups()), "the toy has both kinds of groups"
    for group in layout.groups():
        if group not in copies:
            out = torch.zeros(group.nbytes, dtype=torch.uint8)
            land(layout.fill(group, sources, out), out)
    for trainer in range(world):
        ranges = row_shards(sources, world, trainer)
        shards = ShardSource(sources, {n: tuple(r) for n, r in ranges.items()}).local_shards(list(sources))
        for group in copies:
            inputs = {n: ranges[n] for n in group.inputs}
            packing = compile_packing(layout, group, inputs, params, with_constants=trainer == 0)
            out = torch.zeros(packing.nbytes, dtype=torch.uint8)
            packing.fill(shards, out)
            land(packing.regions, out)
    for name, data in held.items():
        assert torch.equal(data, expected[name].view(-1).view(torch.uint8)), f"{name}: bytes differ from the loader's"


def test_only_groups_with_constants_get_a_scratch_of_their_size_at_connect(monkeypatch):
    """`has_constants` says which copy groups `fill_constants` writes anything for (the oracle:
    what it writes into a zeroed buffer of the group's size); packing every group makes such a
    buffer for those alone (a connect at Kimi-K2's size spent most of its time zeroing one for
    every group)."""
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    _, _, table = engine_rank(2, 1, sources)
    layout = ToyTarget().layout(table, specs_of(sources))
    copies = [g for g in layout.groups() if layout.copy_runs(g, {}) is not None]
    with_constants = [g for g in copies if layout.fill_constants(g, torch.zeros(g.nbytes, dtype=torch.uint8))]
    assert with_constants and len(with_constants) < len(copies), "the padded embedding has constants, the rest none"
    assert [g for g in copies if layout.has_constants(g)] == with_constants
    filled: list = []
    real = type(layout).fill_constants
    monkeypatch.setattr(type(layout), "fill_constants", lambda self, g, out: filled.append(g) or real(self, g, out))
    whole = {n: [(0, t.numel())] for n, t in sources.items()}
    params = {p.name: p for p in table.params}
    for group in copies:
        compile_packing(layout, group, {n: whole[n] for n in group.inputs}, params, with_constants=True)
    assert filled == with_constants


def test_strided_runs_pack_into_one_copy_and_one_write():
    """The toy splits `o` by columns: from a trainer rank holding whole rows, each row is a run of
    the target; packed back to back they are one strided copy, and, contiguous on the target,
    one write."""
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    _, _, table = engine_rank(2, 1, sources)
    layout = ToyTarget().layout(table, specs_of(sources))
    (o,) = [g for g in layout.groups() if g.outputs == ("layers.0.o",)]
    whole = {"layers.0.o.weight": [(0, HIDDEN * HEADS * HEAD_DIM)]}
    assert len(layout.copy_runs(o, whole)) == HIDDEN
    packing = compile_packing(layout, o, whole, {p.name: p for p in table.params}, with_constants=False)
    (copy,) = packing.copies
    assert (copy.count, copy.length, copy.stride, copy.first) == (HIDDEN, HEADS // 2 * HEAD_DIM, HEADS * HEAD_DIM, 8)
    assert [(r.param, r.param_offset, r.nbytes) for r in packing.regions] == [("layers.0.o", 0, HIDDEN * 8 * 4)]


@pytest.mark.parametrize("claims", ["whole", "overlapping"])
def test_a_gather_free_session_updates_toy_engines_bit_exact(claims):
    """Session(gather="auto") sends the copy groups without a gather and the rest (the norms)
    gathered; claims that cover a tensor twice are not trusted: it is gathered instead."""
    sources = state_of(hf_model(1))
    numel = sources["layers.0.q.weight"].numel()
    twice = {"layers.0.q.weight": ((0, numel), (numel // 2, numel))} if claims == "overlapping" else {}
    with toy_session(ShardSource(sources, twice), gather="auto") as (session, engines):
        free, gathered = session.stats().gather_free_bytes
        norms = 2 * LAYERS * HIDDEN * 4  # per rank's unit
        qkv = 2 * 3 * HEADS // 2 * HEAD_DIM * HIDDEN * 4  # layer 0's fused qkv, which reads q
        assert (free > 0, gathered) == (True, norms + (qkv if twice else 0))
        steps: list[tuple[int, int]] = []
        report = session.update("v1", progress=lambda done, total: steps.append((done, total)))
        assert report.ok and all(e.checked for e in report.engines.values()), report.format()
        assert (report.gather_free_bytes, report.gathered_bytes) == (free, gathered)
        assert f"produced: {free:,} bytes gather-free, {gathered:,} from gathers" in report.format()
        # told in bytes after each step: each unit sent gather-free, then each gathered bucket
        dones, totals = [done for done, _ in steps], {total for _, total in steps}
        buckets = len(session.stats().buckets)
        assert len(steps) > buckets > 0 and totals == {dones[-1]} and dones == sorted(dones), steps
        assert dones[-1] - dones[-buckets - 1] == gathered and dones[-buckets - 1] >= free > 0, steps
    assert_own_load(engines, sources, "v1")
