"""The plan: which sender serves which target.

Deterministic, so every trainer rank computes the same plan from the same
inputs without talking to the others. The rule follows miles: first every sender
gets one target so that all of them send in parallel (distinct layout key and
rank first, since those bytes must be produced anyway); every further target of
a (layout key, rank) already served goes to the least loaded sender that serves
it, so its bytes are produced once and sent to several engines; every further
new (layout key, rank) goes to the least loaded sender.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.types import TargetId


@dataclass(frozen=True)
class PlanTarget:
    """A target as the plan sees it: its id, what decides its bytes, and how many."""

    target: TargetId
    unit: str  # layout key text and rank: targets with equal units receive equal bytes
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Each target's sender, and each sender's targets in sending order."""

    senders: tuple[int, ...]
    assignment: dict[TargetId, int]
    load: dict[int, int] = field(default_factory=dict)

    def targets_of(self, sender: int) -> list[TargetId]:
        return [t for t, s in self.assignment.items() if s == sender]


def build_plan(senders: Sequence[int], targets: Sequence[PlanTarget]) -> Plan:
    """Assign every target to exactly one sender."""
    if not senders:
        raise ValueError("a plan needs at least one sender")
    senders = tuple(senders)
    # Units in a fixed order; within a unit, targets by engine id.
    by_unit: dict[str, list[PlanTarget]] = defaultdict(list)
    for t in sorted(targets, key=lambda t: (t.unit, t.target.engine_id)):
        by_unit[t.unit].append(t)
    unit_order = sorted(by_unit, key=lambda u: (u.rpartition("#")[0], by_unit[u][0].target.rank))

    assignment: dict[TargetId, int] = {}
    load = dict.fromkeys(senders, 0)
    serving: dict[str, list[int]] = defaultdict(list)

    def give(t: PlanTarget, sender: int) -> None:
        assignment[t.target] = sender
        load[sender] += t.nbytes
        if sender not in serving[t.unit]:
            serving[t.unit].append(sender)

    # Round one: one target per sender, distinct units first, then further engines'
    # copies of those units, so that every sender has something to send.
    firsts = [by_unit[u][0] for u in unit_order]
    copies = [t for u in unit_order for t in by_unit[u][1:]]
    first_round = (firsts + copies)[: len(senders)]
    for sender, t in zip(senders, first_round):
        give(t, sender)

    def least_loaded(candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda s: (load[s], senders.index(s)))

    # The rest: new units to the least loaded sender, copies to the least loaded sender of their unit.
    for t in [t for t in firsts if t.target not in assignment]:
        give(t, least_loaded(senders))
    for t in [t for t in copies if t.target not in assignment]:
        give(t, least_loaded(serving[t.unit]))
    return Plan(senders=senders, assignment=assignment, load=load)


def unit_of(layout_key_text: str, rank: int) -> str:
    """The unit text of a target: its layout key and rank."""
    return f"{layout_key_text}#{rank}"
