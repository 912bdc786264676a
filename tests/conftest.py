"""Fixtures the tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2psync.core.rendezvous import Rendezvous


@pytest.fixture
def rendezvous() -> Rendezvous:
    """A rendezvous hosted by the test process (job "test", short timeouts)."""
    return Rendezvous(host="127.0.0.1", port=0, job_id="test", is_server=True, timeout=2)


@pytest.fixture
def engine_group() -> Iterator[object]:
    """Torch engine processes serving `small_model` over Mooncake, started by the test with
    `engine_group.start(engine_id, ...)`; stopped (or killed) at the end."""
    from tests.helpers.engines import engines

    with engines() as group:
        yield group
