"""The pipeline model of an update: stages over chunks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2psync.planner.pipeline import Step, chunks_of, pipeline_seconds, shared_seconds


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


def _jobs(stages: list[Step], chunks: list[float]) -> list[list[Step]]:
    return [[step.scaled(chunk) for step in stages] for chunk in chunks]


@given(
    stages=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=4),
    chunks=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=6),
)
def test_stages_that_fit_the_cores_run_as_the_pipeline_does(stages: list[float], chunks: list[float]) -> None:
    total = sum(chunks)
    chunks = [c / total for c in chunks]
    steps = [Step(f"stage {i}", seconds, cpu_seconds=seconds) for i, seconds in enumerate(stages)]
    # one core per stage at most: as many cores as stages leave each its own
    assert shared_seconds(_jobs(steps, chunks), cores=len(stages)) == pytest.approx(pipeline_seconds(stages, chunks))


def test_steps_that_want_more_cores_than_there_are_share_them() -> None:
    # production then wire, each 1 s of one core's CPU for all the bytes, over 100 chunks on one
    # core: they run at once and each gets half the core, so their 2 CPU-seconds take 2 s
    steps = [Step("production", 1.0, 1.0), Step("wire", 1.0, 1.0)]
    assert shared_seconds(_jobs(steps, [0.01] * 100), cores=1) == pytest.approx(2.0)
    # with two cores, the pipeline: 1 s plus the first chunk's production
    assert shared_seconds(_jobs(steps, [0.01] * 100), cores=2) == pytest.approx(1.01)
    # a wire that spends no CPU runs at its own pace beside a CPU-bound step: 1 s of production on
    # half a core's share is not taken, it gets the whole core
    steps = [Step("production", 1.0, 1.0), Step("wire", 1.0, 0.0)]
    assert shared_seconds(_jobs(steps, [0.5, 0.5]), cores=1) == pytest.approx(1.5)
    # a step that alone wants 2 cores (gathers on two trainer ranks) on 1 core takes twice as long
    assert shared_seconds([[Step("gathers", 1.0, 2.0)]], cores=1) == pytest.approx(2.0)
    # max-min fair on 2 cores: "a" (0.5 core wanted) runs beside "b" (3 wanted) and gets all it
    # wants, "b" the 1.5 left (half speed) for 1 s, then 2 of its 3 alone for its last half: 0.75 s
    # more (equal shares of 1 core each would leave "b" a third done at 1 s: 2.0 s in all)
    jobs = [[Step("enter", 0.0), Step("a", 1.0, 0.5)], [Step("b", 1.0, 3.0)]]
    assert shared_seconds(jobs, cores=2) == pytest.approx(1.75)

def test_one_thread_feeds_the_pipeline_its_chunks_in_order() -> None:
    # a first part sends its own shards (production then wire); the second part's gathers may
    # start only once the thread produced the first part's last chunk, not beside it
    own = [[Step("main", 0.5, 0.5), Step("wire", 1.0)]]
    gathered = [[Step("gathers", 1.0, 1.0), Step("main", 0.5, 0.5), Step("wire", 1.0)]]
    # own production 0.5, then gathers 1.0 (the wire sends own meanwhile), production 0.5, wire 1.0
    assert shared_seconds(own + gathered, cores=4) == pytest.approx(3.0)
    # two steps of one job on one resource run one after the other, the next job after both
    serial = [[Step("main", 1.0), Step("main", 1.0), Step("wire", 0.5)] for _ in range(2)]
    assert shared_seconds(serial, cores=4) == pytest.approx(4.5)
