"""Faults placed between an update's steps: `update(progress=)` counts bytes, the tests count steps."""

from __future__ import annotations

from collections.abc import Callable


def after_step(step: int, action: Callable[[], object]) -> Callable[[int, int], None]:
    """A `progress` callback that runs `action` once, when the update's `step`-th step is done
    (a step: each unit a rank sends gather-free, then each bucket it gathers)."""
    told = 0

    def progress(done: int, total: int) -> None:
        nonlocal told
        told += 1
        if told == step:
            action()

    return progress
