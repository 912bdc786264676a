"""The pipeline model of an update: stages over chunks."""

import pytest

from p2psync.planner.pipeline import chunks_of, pipeline_seconds


def test_a_pipeline_takes_its_largest_stage_plus_the_others_first_and_last_chunks() -> None:
    assert chunks_of(100, 40) == [0.4, 0.4, 0.2]
    assert chunks_of(0, 40) == [1.0]
    assert pipeline_seconds([3.0], [0.5, 0.5]) == 3.0
    # production 1 s, wire 4 s, two equal chunks: the first chunk's production, then the wire
    assert pipeline_seconds([1.0, 4.0], [0.5, 0.5]) == pytest.approx(0.5 + 4.0)
    # the wire waiting for production: the last chunk's wire comes after all production
    assert pipeline_seconds([4.0, 1.0], [0.5, 0.5]) == pytest.approx(4.0 + 0.5)
    # three stages, four chunks: the middle one bounds; the first stage's first chunk and the last one's last add
    assert pipeline_seconds([1.0, 2.0, 1.0], [0.25] * 4) == pytest.approx(0.25 + 2.0 + 0.25)
