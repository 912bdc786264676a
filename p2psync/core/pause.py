"""Pause modes: what an engine does with the requests in flight while an update writes its weights.

- ``"abort"``: requests in flight end at once, answered with the engine's abort reason; their
  work is lost and the client must send them again.
- ``"retract"``: running requests go back to the engine's queue and drop their KV cache; after
  the update they resume, recomputing their prefix with the new weights. Nothing is lost but
  the recompute.
- ``"in_place"``: the running batch freezes with its KV cache; after the update it continues on
  the new weights, attending to KV that the old weights computed (an engine holding requests
  cannot flush its caches). vLLM calls it ``"keep"``.
- ``"wait"``: the engine admits no new request and the pause returns once every request in
  flight has finished on the old weights (a drain): nothing is lost, the update waits for the
  longest request.

An engine lists the modes it has in its order of preference; a session that asks for none
takes each engine's first mode that aborts nothing.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Literal

from .errors import OptionsError

PauseMode = Literal["abort", "retract", "in_place", "wait"]
PAUSE_MODES: tuple[PauseMode, ...] = typing.get_args(PauseMode)
#: Other engines' names for the same modes.
ALIASES: dict[str, PauseMode] = {"keep": "in_place"}


def pause_mode(value: str) -> PauseMode:
    """`value` (a mode or an alias) as a pause mode; OptionsError naming the modes."""
    if value in ALIASES:
        return ALIASES[value]
    if value not in PAUSE_MODES:
        raise OptionsError(f"pause mode {value!r} is not one of {', '.join(PAUSE_MODES + tuple(ALIASES))}")
    return value


def choose(asked: PauseMode | None, offered: Sequence[PauseMode], engine: str) -> PauseMode:
    """The mode `engine` (which has `offered`, best first) pauses in: `asked`, or with None its
    first mode that aborts nothing (abort only where it has nothing else). OptionsError where it
    lacks the mode asked, naming the engine and the modes it has."""
    if not offered:
        raise OptionsError(f"engine {engine} names no pause mode")
    if asked is None:
        return next((mode for mode in offered if mode != "abort"), offered[0])
    if asked not in offered:
        raise OptionsError(f"engine {engine} cannot pause in mode {asked!r}; it has {', '.join(offered)}")
    return asked
