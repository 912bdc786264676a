"""IterableSource (p2psync/integrations/iterable.py) in a gloo world of 3 ranks, each iterating
the same stream of full HF tensors as the frameworks' weight generators hand them out: every
rank keeps exactly its `torch.chunk` rows of each tensor (torch's own split is the oracle: 1/3
of the model per rank, never a copy of it), the ranks' gather-free ranges cover every element
once with the stream's values, `gather` rebuilds the stream's tensors bit for bit, and a stream
that differs from the first is refused naming the tensor."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.ranks import run_ranks

WORLD = 3


def stream(step: int) -> list[tuple[str, Any]]:
    """A model's tensors as a weight generator yields them: rows that split unevenly over 3
    ranks, fewer rows than ranks, a scalar, and two dtypes."""
    import torch

    g = torch.Generator().manual_seed(step)
    return [
        ("embed.weight", torch.randn(7, 4, generator=g)),
        ("norm.weight", torch.randn(2, generator=g).to(torch.bfloat16)),
        ("layer.weight", torch.randn(5, 3, 2, generator=g).to(torch.bfloat16)),
        ("scale", torch.randn((), generator=g)),
    ]


def plain(tensor: Any) -> tuple[str, tuple[int, ...], list[float]]:
    """A tensor as plain values (a tensor through a queue would outlive the process that shares it)."""
    return str(tensor.dtype), tuple(tensor.shape), tensor.float().reshape(-1).tolist()


def _rank(rank: int) -> dict[str, Any]:
    import torch

    from p2psync.integrations.iterable import IterableSource

    out: dict[str, Any] = {}
    source = IterableSource()
    source.take(iter(stream(1)))
    names = [s.name for s in source.param_specs()]
    out["specs"] = [(s.name, s.shape, s.dtype) for s in source.param_specs()]
    out["held"] = source.held_bytes
    out["shards"] = {n: (s.ranges, plain(s.data)[2]) for n, s in source.local_shards(names).items()}
    out["gathered"] = {n: plain(t) for n, t in source.gather(names).items()}
    source.release()
    out["released"] = source.held_bytes
    source.take(iter(stream(2)))  # the next update: the same tensors, other values
    out["second"] = {n: plain(t) for n, t in source.gather(names).items()}
    refusals = {
        "shape": [*stream(3)[:1], ("norm.weight", torch.zeros(3, dtype=torch.bfloat16)), *stream(3)[2:]],
        "missing": stream(3)[:3],
        "twice": [*stream(3), stream(3)[0]],
        "new": [*stream(3), ("extra.bias", torch.zeros(2))],
    }
    for how, tensors in refusals.items():
        try:
            source.take(iter(tensors))
            out[how] = "no error"
        except ValueError as exc:
            out[how] = str(exc)
    return out


@pytest.fixture(scope="module")
def world() -> dict[int, dict[str, Any]]:
    return run_ranks(_rank, WORLD)


def _rows(tensor: Any) -> Any:
    return tensor.reshape(tensor.shape or (1,))


def test_each_rank_holds_its_torch_chunk_rows_of_the_stream_only(world):
    tensors = dict(stream(1))
    model_bytes = sum(t.nbytes for t in tensors.values())
    for rank, out in world.items():
        chunks = {n: _rows(t).chunk(WORLD) for n, t in tensors.items()}
        mine = sum(c[rank].nbytes for c in chunks.values() if rank < len(c))
        assert out["held"] == mine, (rank, out["held"], mine)
        assert out["held"] < model_bytes / 2, "a rank holds a copy of much of the model"
        assert out["released"] == 0
    assert sum(out["held"] for out in world.values()) == model_bytes


def test_the_ranks_gather_free_ranges_cover_every_element_once_with_the_streams_values(world):
    for name, tensor in stream(1):
        flat = plain(tensor)[2]
        covered = []
        for rank, out in world.items():
            ranges, data = out["shards"][name]
            offset = 0
            for start, end in ranges:
                assert data[offset : offset + end - start] == flat[start:end], (name, rank, start, end)
                covered.append((start, end))
                offset += end - start
            assert offset == len(data), (name, rank)
        covered.sort()
        assert [a for a, _ in covered[1:]] == [b for _, b in covered[:-1]], (name, covered)
        assert (covered[0][0], covered[-1][1]) == (0, len(flat)), (name, covered)


def test_gather_rebuilds_each_updates_tensors_bit_for_bit(world):
    for rank, out in world.items():
        assert out["specs"] == [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in stream(1)]
        for step, got in ((1, out["gathered"]), (2, out["second"])):
            for name, tensor in stream(step):
                assert got[name] == plain(tensor), (rank, step, name)


def test_a_stream_that_differs_from_the_first_is_refused_naming_the_tensor(world):
    for out in world.values():
        assert "'norm.weight'" in out["shape"] and "(3,)" in out["shape"], out["shape"]
        assert "ended without 1 HF tensor(s): scale" in out["missing"], out["missing"]
        assert "'embed.weight' twice" in out["twice"], out["twice"]
        assert "'extra.bias'" in out["new"] and "not in its first update" in out["new"], out["new"]
