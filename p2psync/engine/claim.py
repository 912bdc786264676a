"""One engine id, one engine: a rank publishes its table as its claim on the id, and replaces
a predecessor only openly, a dead one as the next incarnation, a live one only for a higher
requested incarnation (which retires it)."""

from __future__ import annotations

import dataclasses
import logging
import urllib.error
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.control import post
from ..core.errors import ControlError, RendezvousError, first_line, where
from ..core.types import TargetTable

if TYPE_CHECKING:
    from ..core.rendezvous import Rendezvous

log = logging.getLogger(__name__)

#: Seconds a starting endpoint waits for the holder of its engine id to answer.
PROBE_TIMEOUT = 5.0


def claim(
    rendezvous: Rendezvous, table: TargetTable, *, incarnation: int | None, token: str,
    publishing: Callable[[TargetTable], None],
) -> TargetTable:
    """Publish `table` (`incarnation`: the one its endpoint asked for, if any); the table
    published, its incarnation the one it took. `publishing(table)` is told each table before
    it is published: a trainer may read it and ask the endpoint who it is at once, before the
    claim returns (a retired predecessor may take seconds to be told)."""
    holder: TargetTable | None = None
    for _ in range(8):  # another claimant may win each round; it then holds the place
        publishing(table)
        held = rendezvous.publish(table, replacing=holder)
        if held is None:
            if holder is not None:
                _replaced(holder, table, token)
            return table
        holder = held
        table = dataclasses.replace(table, incarnation=_next_incarnation(held, incarnation, token))
    raise RendezvousError(f"{_where(table)}: its rendezvous place kept changing hands; start it again")


def _where(table: TargetTable) -> str:
    return where(table.engine_id, table.rank)


def _next_incarnation(held: TargetTable, asked: int | None, token: str) -> int:
    described = f"incarnation {held.incarnation} at {held.control_url} ({held.instance})"
    if asked is not None:
        if asked > held.incarnation:
            return asked
        raise RendezvousError(
            f"{_where(held)} is served by {described}; incarnation={asked} does not replace it: give a higher one"
        )
    answer = _probe(held, token)
    if answer is not None:
        raise RendezvousError(
            f"{_where(held)} is already served by {described}; {answer}: stop it, use another engine id, "
            f"or start this one with incarnation={held.incarnation + 1} to replace it"
        )
    log.warning("%s: replacing %s, which no longer answers", _where(held), described)
    return held.incarnation + 1


def _probe(held: TargetTable, token: str) -> str | None:
    """Why `held`'s publisher counts as alive, or None if it is gone."""
    try:
        answer = post(held.control_url, "info", token=token, timeout=PROBE_TIMEOUT)
    except ControlError as exc:
        if isinstance(exc.__cause__, urllib.error.URLError) and isinstance(
            exc.__cause__.reason, ConnectionRefusedError
        ):
            return None
        return f"its control endpoint did not refuse a connection ({first_line(exc)})"
    if answer.get("instance") != held.instance:
        return None  # another process took its port
    return "it still answers"


def _replaced(holder: TargetTable, table: TargetTable, token: str) -> None:
    """Tell a replaced predecessor, should it still run, to stop serving for good."""
    log.warning(
        "%s: incarnation %d replaces incarnation %d (%s)", _where(table), table.incarnation, holder.incarnation,
        holder.instance,
    )
    try:
        post(holder.control_url, "retire", {"incarnation": table.incarnation}, token=token, timeout=PROBE_TIMEOUT)
    except ControlError as exc:  # a dead predecessor retires by itself
        log.info("%s: predecessor not told to retire: %s", _where(table), exc)
