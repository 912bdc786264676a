"""The plan: which sender of a group serves which engine rank."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.trainer.plan import PlanTarget, build_plan, unit_of
from p2psync.core.types import TargetId

SETTINGS = settings(max_examples=100, deadline=None)


def key_text(**key: object) -> str:
    """Layout key text as TargetTable.layout_key_text writes it."""
    return json.dumps({"engine": "sglang", **key}, sort_keys=True)


def stage_ranks(world: int, pp: int, stage: int) -> tuple[int, ...]:
    """Megatron's default rank order puts pipeline parallelism outermost: stage `s`
    holds the contiguous block of world/pp ranks starting at s * world/pp."""
    per_stage = world // pp
    return tuple(r for r in range(world) if r // per_stage == stage)


def engine_targets(engine: str, ranks: int, key: str, nbytes: int = 1000) -> list[PlanTarget]:
    return [PlanTarget(TargetId(engine, r), unit_of(key, r), nbytes) for r in range(ranks)]


# -- the worked example of the design: pp=4 trainer, two 16-rank engines --------------------


def test_pp4_of_32_ranks_gives_stage_groups_of_8() -> None:
    assert stage_ranks(32, 4, 0) == tuple(range(8))
    assert stage_ranks(32, 4, 3) == tuple(range(24, 32))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_two_engines_of_16_ranks_on_8_senders(stage: int) -> None:
    senders = stage_ranks(32, 4, stage)
    assert len(senders) == 8
    key = key_text(tp=16, dtype="bfloat16")
    targets = engine_targets("engine-a", 16, key) + engine_targets("engine-b", 16, key)

    plan = build_plan(senders, targets)

    for i, sender in enumerate(senders):
        expected = {TargetId(e, r) for e in ("engine-a", "engine-b") for r in (i, i + 8)}
        assert set(plan.targets_of(sender)) == expected, f"sender {sender}"
        assert plan.load[sender] == 4 * 1000
    assert len(plan.assignment) == 32
    assert plan.senders == senders


def test_two_engines_same_result_whatever_the_input_order() -> None:
    key = key_text(tp=16)
    targets = engine_targets("engine-a", 16, key) + engine_targets("engine-b", 16, key)
    forward = build_plan(range(8), targets).assignment
    backward = build_plan(range(8), list(reversed(targets))).assignment
    assert forward == backward


def test_copies_spread_over_idle_senders_in_the_first_round() -> None:
    # Four single-rank engines with the same layout: one unit, four senders.
    # Every sender gets one engine so that all of them send in parallel.
    key = key_text(tp=1)
    targets = [t for e in "abcd" for t in engine_targets(f"engine-{e}", 1, key)]
    plan = build_plan([0, 1, 2, 3], targets)
    assert sorted(plan.assignment.values()) == [0, 1, 2, 3]


def test_more_senders_than_targets_leaves_some_idle() -> None:
    targets = engine_targets("engine-a", 2, key_text(tp=2))
    plan = build_plan(range(8), targets)
    assert sorted(plan.assignment.values()) == [0, 1]
    assert plan.targets_of(5) == []


def test_distinct_layouts_are_not_mixed_up() -> None:
    # Same rank index, different layout keys: different bytes, so they are not copies.
    targets = engine_targets("engine-a", 2, key_text(tp=2)) + engine_targets("engine-b", 2, key_text(tp=1, ep=2))
    plan = build_plan([10, 11], targets)
    assert {plan.assignment[t.target] for t in targets} == {10, 11}
    # Two units per sender (four units, two senders), none of them served twice.
    served = defaultdict(set)
    for t in targets:
        served[t.unit].add(plan.assignment[t.target])
    assert all(len(s) == 1 for s in served.values())


def test_no_targets_gives_an_empty_plan() -> None:
    plan = build_plan([0, 1], [])
    assert plan.assignment == {}
    assert plan.load == {0: 0, 1: 0}


def test_no_senders_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one sender"):
        build_plan([], engine_targets("engine-a", 1, key_text()))


# -- properties -----------------------------------------------------------------------------


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[list[int], list[PlanTarget]]:
    """Distinct sender ranks (not necessarily 0-based) and the targets of a few engines.

    Targets with equal unit have equal nbytes, as they hold equal bytes."""
    senders = draw(st.lists(st.integers(0, 63), min_size=1, max_size=10, unique=True))
    keys = [key_text(tp=tp) for tp in (1, 2, 4)]
    unit_bytes: dict[str, int] = {}
    targets: list[PlanTarget] = []
    for e in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(keys))
        for r in range(draw(st.integers(1, 8))):
            unit = unit_of(key, r)
            if unit not in unit_bytes:
                unit_bytes[unit] = draw(st.integers(1, 10_000))
            targets.append(PlanTarget(TargetId(f"engine-{e}", r), unit, unit_bytes[unit]))
    return senders, targets


@SETTINGS
@given(plan_inputs())
def test_every_target_exactly_once_and_only_to_given_senders(inputs: tuple[list[int], list[PlanTarget]]) -> None:
    senders, targets = inputs
    plan = build_plan(senders, targets)
    assert set(plan.assignment) == {t.target for t in targets}
    assert set(plan.assignment.values()) <= set(senders)
    by_sender = [t for s in senders for t in plan.targets_of(s)]
    assert sorted(by_sender, key=str) == sorted((t.target for t in targets), key=str)  # a partition
    nbytes = {t.target: t.nbytes for t in targets}
    for s in senders:
        assert plan.load[s] == sum(nbytes[t] for t in plan.targets_of(s))


@SETTINGS
@given(plan_inputs())
def test_every_sender_busy_when_targets_suffice(inputs: tuple[list[int], list[PlanTarget]]) -> None:
    senders, targets = inputs
    plan = build_plan(senders, targets)
    used = set(plan.assignment.values())
    if len(targets) >= len(senders):
        assert used == set(senders)
    else:
        assert len(used) == len(targets)  # one target each, as many senders as targets


@SETTINGS
@given(plan_inputs(), st.data())
def test_same_inputs_in_any_order_give_the_same_plan(
    inputs: tuple[list[int], list[PlanTarget]], data: st.DataObject
) -> None:
    senders, targets = inputs
    shuffled = data.draw(st.permutations(targets))
    first = build_plan(senders, targets)
    second = build_plan(senders, shuffled)
    assert first.assignment == second.assignment
    assert first.load == second.load
    for s in senders:
        assert first.targets_of(s) == second.targets_of(s)


@SETTINGS
@given(plan_inputs())
def test_bytes_produced_are_balanced(inputs: tuple[list[int], list[PlanTarget]]) -> None:
    """Ignoring copies (a unit a sender already serves costs no new production), the
    loads of the senders differ by at most the largest target."""
    senders, targets = inputs
    if not targets:
        return
    plan = build_plan(senders, targets)
    units_of: dict[int, dict[str, int]] = {s: {} for s in senders}
    for t in targets:
        units_of[plan.assignment[t.target]][t.unit] = t.nbytes
    produced = [sum(u.values()) for u in units_of.values()]
    assert max(produced) - min(produced) <= max(t.nbytes for t in targets)


@SETTINGS
@given(plan_inputs())
def test_targets_of_one_unit_stay_with_its_senders(inputs: tuple[list[int], list[PlanTarget]]) -> None:
    """A further target of a unit goes to a sender already serving it: with at least
    as many units as senders each unit has a single sender; with fewer, the first
    round spreads copies over the idle senders and each sender serves a single unit."""
    senders, targets = inputs
    plan = build_plan(senders, targets)
    senders_of: dict[str, set[int]] = defaultdict(set)
    units_of: dict[int, set[str]] = defaultdict(set)
    for t in targets:
        s = plan.assignment[t.target]
        senders_of[t.unit].add(s)
        units_of[s].add(t.unit)
    if len(senders_of) >= len(senders):
        assert all(len(s) == 1 for s in senders_of.values()), senders_of
    else:
        assert all(len(u) == 1 for u in units_of.values()), units_of
