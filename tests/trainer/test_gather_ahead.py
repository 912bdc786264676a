"""The gathering update's gathers run one bucket ahead of its production: bucket i + 1 is
gathered while bucket i is produced, in order, never more than two buckets at once, and a
gather's error reaches the update's thread."""

from __future__ import annotations

import threading

import pytest
import torch

from p2psync.trainer.gather_ahead import GatherAhead

BUCKETS = [["a"], ["b"], ["c"], ["d"]]


def test_the_next_bucket_is_gathered_while_this_one_is_produced_and_no_further():
    gathered: list[str] = []
    second_gathered = threading.Event()

    def gather(names):
        gathered.append(names[0])
        if names[0] == "b":
            second_gathered.set()
        return {n: torch.full((2,), ord(n)) for n in names}

    ahead = GatherAhead(gather, BUCKETS)
    seen = []
    for index, tensors in ahead:
        if index == 0:
            # bucket 0 is being produced: bucket 1 is gathered meanwhile, bucket 2 not yet
            assert second_gathered.wait(10), "the next bucket was not gathered during production"
            assert gathered == ["a", "b"], gathered
        seen.append((index, {n: t.tolist() for n, t in tensors.items()}))
    ahead.close()
    assert seen == [(i, {b[0]: [ord(b[0])] * 2}) for i, b in enumerate(BUCKETS)]
    assert gathered == ["a", "b", "c", "d"]


def test_a_failed_gather_is_raised_in_the_consumer_and_nothing_after_it_is_gathered():
    gathered: list[str] = []

    def gather(names):
        gathered.append(names[0])
        if names[0] == "b":
            raise RuntimeError("all-gather of b failed")
        return {n: torch.zeros(1) for n in names}

    ahead = GatherAhead(gather, BUCKETS)
    with pytest.raises(RuntimeError, match="all-gather of b failed"):
        for _ in ahead:
            pass
    ahead.close()
    assert gathered == ["a", "b"]


def test_closing_early_stops_the_thread_before_its_next_gather():
    gathered: list[str] = []
    ahead = GatherAhead(lambda names: gathered.append(names[0]) or {}, BUCKETS)
    for index, _ in ahead:
        if index == 0:
            break
    ahead.close()
    assert gathered in (["a"], ["a", "b"]), gathered  # at most the bucket ahead
