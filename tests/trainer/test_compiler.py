"""The connection compiler on its own: no transport, no engine process, no collective.

Two toy engines of TP 2 (one layout key, so each rank's bytes are produced once and written
to both) and a sender group of two trainer ranks. Each rank's compiled work is carried out by
hand: its packings filled from its own rows, its groups filled from the full tensors, every
region landed on the engine rank's initial bytes. The oracle is the toy engine's own loader.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2psync.conformance.base import row_shards, specs_of
from p2psync.core.types import SenderGroup, TargetTable
from p2psync.trainer.compiler import SenderView, compile_connection, held_once
from p2psync.trainer.plan import unit_of
from tests.helpers.toy_engine import ShardSource, ToyTarget, engine_rank, hf_model

TP, WORLD = 2, 2


def engines(sources):
    """Engines toy-0 and toy-1, each rank as (model, expected bytes, table)."""
    out = {}
    for engine_id in ("toy-0", "toy-1"):
        ranks = [engine_rank(TP, r, sources) for r in range(TP)]
        out[engine_id] = [(m, e, dataclasses.replace(t, engine_id=engine_id)) for m, e, t in ranks]
    return out


def compile_for(rank, tables, sources, held):
    layouts = {}
    for table in (t for ts in tables.values() for t in ts):
        layouts.setdefault(unit_of(table.layout_key_text, table.rank), ToyTarget().layout(table, specs_of(sources)))
    sender = SenderView(rank, tuple(range(WORLD)), specs_of(sources), 1 << 20, lambda name: "")
    return compile_connection(tables, layouts, sender, held)


def land(held, written, table: TargetTable, regions, out):
    for r in regions:
        span = slice(r.param_offset, r.param_offset + r.nbytes)
        assert not written[table.target][r.param][span].any(), f"{table.target} {r.param}: written twice"
        held[table.target][r.param][span] = out[r.buffer_offset : r.buffer_offset + r.nbytes]
        written[table.target][r.param][span] = True


@pytest.mark.parametrize("gather_free", [False, True])
def test_every_ranks_compiled_work_rebuilds_each_engines_own_load(gather_free):
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    ranks = engines(sources)
    tables = {e: [t for _, _, t in rs] for e, rs in ranks.items()}
    rows = [row_shards(sources, WORLD, r) for r in range(WORLD)]
    held_ranges = [{n: tuple(map(tuple, r)) for n, r in rs.items()} for rs in rows] if gather_free else []
    held = {t.target: {n: p.data.view(-1).view(torch.uint8).clone() for n, p in m.named_parameters()}
            for rs in ranks.values() for m, _, t in rs}
    written = {target: {n: torch.zeros(d.numel(), dtype=torch.bool) for n, d in params.items()}
               for target, params in held.items()}

    plans = []
    for rank in range(WORLD):
        compiled = compile_for(rank, tables, sources, held_ranges)
        plans.append(compiled.plan)
        assert bool(compiled.packed) == gather_free
        source = ShardSource(sources, held_ranges[rank] if gather_free else None)
        for writes, packings in compiled.packed:
            for packing in packings:
                out = torch.zeros(packing.nbytes, dtype=torch.uint8)
                packing.fill(source.local_shards(packing.sources), out)
                for table in writes.targets:
                    land(held, written, table, packing.regions, out)
        for i, names in enumerate(compiled.buckets):
            tensors = {n: sources[n] for n in names}
            for writes, groups in compiled.work[i]:
                for group in groups:
                    out = torch.zeros(group.nbytes, dtype=torch.uint8)
                    regions = writes.layout.fill(group, tensors, out)
                    for table in writes.targets:
                        land(held, written, table, regions, out)

    assert plans[0] == plans[1], "every rank compiles the same plan"
    assert set(plans[0].assignment) == {t.target for ts in tables.values() for t in ts}
    for rs in ranks.values():
        for _, expected, table in rs:
            for name, data in held[table.target].items():
                assert torch.equal(data, expected[name].view(-1).view(torch.uint8)), f"{table.target} {name} differs"


def test_claims_that_do_not_cover_a_tensor_exactly_once_are_gathered():
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    specs = specs_of(sources)
    name = "layers.0.q.weight"
    n = sources[name].numel()
    whole = {name: ((0, n),)}
    assert held_once([{name: ((0, n // 2),)}, {name: ((n // 2, n),)}], (0, 1), specs) == {name}
    assert held_once([whole, whole], (0, 1), specs) == set(), "covered twice"
    assert held_once([{name: ((0, n // 2),)}, {name: ((n // 2 + 1, n),)}], (0, 1), specs) == set(), "a gap"
    assert held_once([whole, {}], (0, 1), specs) == set(), "a rank that does not say"
    assert held_once([whole, {}], (0,), specs) == {name}, "only the sender group's ranks count"


def test_a_sender_group_is_compiled_with_its_own_ranks():
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    tables = {e: [t for _, _, t in rs] for e, rs in engines(sources).items()}
    group = SenderGroup("all", (0, 1), 0)
    compiled = compile_for(1, tables, sources, [])
    assert compiled.plan.senders == group.ranks
    assert compiled.targets == set(compiled.plan.targets_of(1))
    assert compiled.gather_free_bytes[0] == 0 and compiled.gather_free_bytes[1] > 0


def test_a_second_session_and_a_reconnect_build_no_layout(monkeypatch):
    """Layouts are kept per process under everything that decides them: a second session of the
    same trainer to the same engine, and a reconnect, compile nothing; other engine options do."""
    from p2psync.trainer.layouts import forget_layouts
    from tests.helpers.doubles import DictSource
    from tests.helpers.toy_engine import toy_session

    built = []
    real = ToyTarget.layout
    monkeypatch.setattr(ToyTarget, "layout", lambda self, table, specs: built.append(table.rank) or real(self, table, specs))
    forget_layouts()
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    with toy_session(DictSource(sources)) as (session, _):
        assert sorted(built) == [0, 1]
        session.connect(["toy-0"])
        assert session.update("v1").ok
    with toy_session(DictSource(sources)) as (session, _):
        assert session.update("v1").ok
    assert sorted(built) == [0, 1], "the second session and the reconnect built no layout"
    with toy_session(DictSource(sources), engine_options={"toy": {"layout": "replica"}}) as (session, _):
        assert session.update("v1").ok
    assert sorted(built) == [0, 0, 1, 1], "other engine options are another layout"
