"""Trainer ranks share the compile (p2psync/trainer/layouts.py): in a gloo world of 2, the
layouts of a toy engine of TP 4 are compiled two per rank and exchanged, every rank's layouts
fill exactly what the engine's own loader writes on each engine rank (the oracle), a second
connect takes them from memory and a fresh process from a shared cache directory; a compile
that fails on one rank only fails the connect on both ranks with the same ConnectError,
naming engine, rank and parameter."""

from __future__ import annotations

from typing import Any

import pytest

from p2psync.core.errors import ConnectError, where
from p2psync.trainer.layouts import LayoutCounts, assign
from tests.helpers.ranks import run_ranks
from tests.helpers.toy_engine import ToyTarget

TP = 4


def test_units_nobody_holds_are_balanced_by_bytes_and_held_ones_come_from_a_holder():
    costs = [10, 1, 1, 8, 1]
    assert assign([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]], costs) == {0: 0, 3: 1, 1: 1, 2: 1, 4: 0}
    assert assign([[], [0, 1]], costs) == {0: 0, 1: 0}, "rank 0 holds both"
    assert assign([[], []], costs) == {}


class CountingToy(ToyTarget):
    """The toy engine's target, counting the ranks it compiles; it fails on world rank 1 when
    `fail` says how."""

    built: list[int] = []
    fail: str = ""

    def layout(self, table, sources):
        from p2psync.trainer import collectives

        if collectives.world_rank() == 1 and self.fail == "connect":
            raise ConnectError(f"{where(table.engine_id, table.rank, 'embed')}: refused on this rank only")
        if collectives.world_rank() == 1 and self.fail == "bug":
            raise RuntimeError("a bug on this rank only")
        CountingToy.built.append(table.rank)
        return super().layout(table, sources)


def _rank(rank: int, cache: str) -> dict[str, Any]:
    from p2psync.conformance import EngineCase
    from p2psync.conformance.base import assert_layout_reproduces_the_loader, specs_of
    from p2psync.core.plugins import Registry
    from p2psync.trainer.layouts import LayoutCache, forget_layouts
    from p2psync.trainer.plan import unit_of
    from tests.helpers.toy_engine import engine_rank, hf_model

    out: dict[str, Any] = {}
    sources = {n: t.detach().clone() for n, t in hf_model(0).state_dict().items()}
    ranks = [engine_rank(TP, r, sources) for r in range(TP)]
    tables = [table for _, _, table in ranks]
    registry = Registry()
    registry.add("engine_targets", CountingToy, "tests", "0")

    def connect() -> LayoutCounts:
        cache_of_session = LayoutCache(registry, {}, cache)
        layouts = cache_of_session.layouts(tables, specs_of(sources))
        for engine, expected, table in ranks:
            layout = layouts[unit_of(table.layout_key_text, table.rank)]
            initial = {n: p.data.clone() for n, p in engine.named_parameters()}
            assert_layout_reproduces_the_loader(EngineCase(table, sources, initial, expected, lambda t, s: layout))
        return cache_of_session.counts

    out["first"] = connect(), sorted(CountingToy.built)
    out["again"] = connect()
    forget_layouts()  # a fresh process, the cache directory shared
    out["disk"] = connect()
    out["built"] = sorted(CountingToy.built)
    for how in ("connect", "bug"):
        forget_layouts()
        CountingToy.fail, cache = how, ""
        try:
            connect()
            out[how] = "no error"
        except ConnectError as exc:
            out[how] = str(exc)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[int, dict[str, Any]]:
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("cache")))


@pytest.mark.slow
def test_each_rank_compiles_its_share_and_receives_the_rest_bit_exact(world):
    shares = [world[r]["first"] for r in range(2)]
    assert [counts for counts, _ in shares] == [LayoutCounts(compiled=2, received=2)] * 2
    assert sorted(shares[0][1] + shares[1][1]) == list(range(TP)), "every engine rank compiled once, by one rank"


@pytest.mark.slow
def test_later_connects_take_the_layouts_from_memory_and_from_disk(world):
    for r in range(2):
        assert world[r]["again"] == LayoutCounts(memory=TP)
        assert world[r]["disk"] == LayoutCounts(disk=TP)
        assert world[r]["built"] == world[r]["first"][1], "nothing compiled again"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("connect", "trainer rank 1 compiling a layout: engine 'toy-0' rank 1 parameter 'embed': refused on this rank only"),
        ("bug", "trainer rank 1 compiling a layout: RuntimeError: a bug on this rank only"),
    ],
)
def test_a_compile_that_fails_on_one_rank_fails_on_every_rank_alike(world, how, message):
    assert world[0][how] == world[1][how] == message
