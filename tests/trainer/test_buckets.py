"""Buckets: what the trainer gathers together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.trainer.buckets import make_buckets
from p2psync.core.errors import ConnectError
from p2psync.core.layout import ParamGroup
from p2psync.core.types import ParamSpec

MiB = 1 << 20


def spec(name: str, mib: int) -> ParamSpec:
    """A bfloat16 tensor of `mib` MiB."""
    return ParamSpec(name, (mib, MiB // 2), "bfloat16")


def group(*inputs: str) -> ParamGroup:
    return ParamGroup(tuple(inputs), (inputs[0] + ".out",), 0)


def test_fused_inputs_share_a_bucket_even_past_bucket_bytes() -> None:
    specs = [spec("q", 4), spec("k", 1), spec("v", 1), spec("o", 4), spec("gate", 8), spec("up", 8)]
    groups = [group("q", "k", "v"), group("o"), group("gate", "up")]
    buckets = make_buckets(specs, groups, 5 * MiB)
    assert buckets == [["q", "k", "v"], ["o"], ["gate", "up"]]


def test_small_components_are_packed_up_to_bucket_bytes() -> None:
    specs = [spec(f"w{i}", 1) for i in range(7)]
    buckets = make_buckets(specs, [group(s.name) for s in specs], 3 * MiB)
    assert buckets == [["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"]]


def test_groups_of_different_layouts_tie_tensors_transitively() -> None:
    # One engine fuses gate+up, another up+down: all three must come together.
    specs = [spec("gate", 1), spec("up", 1), spec("down", 1), spec("norm", 1)]
    groups = [group("gate", "up"), group("down"), group("up", "down"), group("norm"), group("gate")]
    buckets = make_buckets(specs, groups, 1 * MiB)
    assert buckets == [["gate", "up", "down"], ["norm"]]


def test_only_names_some_group_reads_are_gathered() -> None:
    specs = [spec("a", 1), spec("unused", 1), spec("b", 1)]
    assert make_buckets(specs, [group("a"), group("b")], 10 * MiB) == [["a", "b"]]
    assert make_buckets(specs, [], 10 * MiB) == []


def test_components_follow_the_trainer_order() -> None:
    specs = [spec("z", 1), spec("a", 1), spec("m", 1)]
    groups = [group("m"), group("a"), group("z")]
    assert make_buckets(specs, groups, 1 * MiB) == [["z"], ["a"], ["m"]]


@st.composite
def bucket_inputs(draw: st.DrawFn) -> tuple[list[ParamSpec], list[ParamGroup], int]:
    n = draw(st.integers(1, 20))
    dtypes = st.sampled_from(["bfloat16", "float32"])
    specs = [ParamSpec(f"t{i}", (draw(st.integers(1, 64)),), draw(dtypes)) for i in range(n)]
    names = [s.name for s in specs]
    groups = [
        ParamGroup(tuple(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))), (f"p{j}",), 0)
        for j in range(draw(st.integers(0, 15)))
    ]
    bucket_bytes = draw(st.integers(1, 600))
    return specs, groups, bucket_bytes


@settings(max_examples=100, deadline=None)
@given(bucket_inputs())
def test_bucket_properties(inputs: tuple[list[ParamSpec], list[ParamGroup], int]) -> None:
    specs, groups, bucket_bytes = inputs
    buckets = make_buckets(specs, groups, bucket_bytes)
    size = {s.name: s.nbytes for s in specs}
    read = {name for g in groups for name in g.inputs}

    # Every name some group reads, exactly once, and nothing else.
    flat = [name for b in buckets for name in b]
    assert sorted(flat) == sorted(read)
    assert all(buckets), "no empty bucket"

    # Every group's inputs in one bucket.
    bucket_of = {name: i for i, b in enumerate(buckets) for name in b}
    for g in groups:
        assert len({bucket_of[name] for name in g.inputs}) == 1, g

    # Components: names tied together by groups, transitively.
    component = {name: {name} for name in read}
    for g in groups:
        merged = set().union(*(component[name] for name in g.inputs))
        for name in merged:
            component[name] = merged
    for b in buckets:
        parts = {frozenset(component[name]) for name in b}
        nbytes = sum(size[name] for name in b)
        # Over bucket_bytes only when a single component is that large by itself.
        assert nbytes <= bucket_bytes or len(parts) == 1, (b, nbytes)
    # Not split needlessly: the next bucket's first component did not fit.
    for prev, nxt in zip(buckets, buckets[1:]):
        first = component[nxt[0]]
        assert sum(size[n] for n in prev) + sum(size[n] for n in first) > bucket_bytes

    # Components appear in the trainer's order of their first member.
    order = [s.name for s in specs]
    firsts = []
    for name in flat:
        head = min(component[name], key=order.index)
        if head not in firsts:
            firsts.append(head)
    assert firsts == sorted(firsts, key=order.index)


def test_kinds_never_share_a_bucket_and_each_kind_fills_its_own():

    specs = [ParamSpec(f"{kind}{i}", (4,), "float32") for i in range(4) for kind in ("attn", "expert")]
    groups = [ParamGroup((s.name,), (s.name,), 16) for s in specs]
    buckets = make_buckets(specs, groups, 32, kind=lambda n: "expert" if n.startswith("expert") else "")
    assert buckets == [["attn0", "attn1"], ["expert0", "expert1"], ["attn2", "attn3"], ["expert2", "expert3"]]


def test_a_group_tying_two_kinds_is_refused():

    specs = [ParamSpec("a", (4,), "float32"), ParamSpec("e", (4,), "float32")]
    with pytest.raises(ConnectError, match=r"HF tensors \['a', 'e'\] feed one engine parameter"):
        make_buckets(specs, [ParamGroup(("a", "e"), ("ae",), 32)], 64, kind=lambda n: "expert" if n == "e" else "")
