"""The conformance of an engine's LoRA adapter slots, for every engine that has them: an
`SlotEngine` says how its ranks are built, served, read and loaded by the engine's own
loader; the checks here are the same for all (the oracle: the engine's own load of the
trainer's adapter on a fresh rank)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2psync import Rendezvous, Session
from p2psync.adapters.peft import LoraSource
from tests.helpers.peft_engine import assert_bytes_equal, lora_model, peft_checkpoint, perturb_first_rows


@dataclass(frozen=True)
class SlotEngine:
    """One engine's LoRA ranks, as these checks use them."""

    #: The engine's name in messages and in its slots' engine ids (`<name>/a`).
    name: str
    #: Every rank of an engine of TP size `tp`, holding no adapter.
    ranks: Callable[[int], list[Any]]
    #: A rank's adapter slots, served over `transport` into `rendezvous` under `<name>/`.
    slots: Callable[[Any, Rendezvous, str], Any]
    #: The bytes a rank holds for adapter `name` (its host copy and its slot, which the engine
    #: loads first where it holds none, as a batch using it would).
    held: Callable[[Any, str], dict[str, torch.Tensor]]
    #: The engine's own load of PEFT's tensors and config as adapter `name` into a rank.
    own_load: Callable[[Any, str, dict[str, torch.Tensor], dict[str, Any]], None]


def own_load(engine: SlotEngine, model: Any, adapter: str, tp: int) -> list[dict[str, torch.Tensor]]:
    """Per rank, what the engine's own load of the trainer's `adapter` leaves there."""
    wanted = []
    for lora in engine.ranks(tp):
        engine.own_load(lora, adapter, *peft_checkpoint(model, adapter))
        wanted.append(engine.held(lora, adapter))
    return wanted


def assert_holds(engine: SlotEngine, ranks: list[Any], adapter: str, wanted: list[dict[str, torch.Tensor]]) -> None:
    for lora, expected in zip(ranks, wanted):
        assert_bytes_equal(engine.held(lora, adapter), expected,
                           f"rank {lora.rank}: adapter {adapter!r}, against {engine.name}'s own load")


def serving(engine: SlotEngine, transport: str, job: str, tp: int = 2) -> tuple[Rendezvous, list[Any], list[Any]]:
    """Every rank holding adapters "a" and "b" (the engine's own load of other random weights than
    the trainer's), served as slots `<name>/a` and `<name>/b`; "a" already in a slot, "b" not."""
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id=job, is_server=True, timeout=60)
    adapters = lora_model({"a": 31, "b": 32})
    ranks, slots = engine.ranks(tp), []
    for lora in ranks:
        rank_slots = engine.slots(lora, rendezvous, transport)
        for adapter in ("a", "b"):
            rank_slots.load(adapter, *peft_checkpoint(adapters, adapter))
        engine.held(lora, "a")
        slots.append(rank_slots)
    return rendezvous, ranks, slots


def check_two_adapters_updated_independently(engine: SlotEngine, transport: str, tp: int) -> None:
    """Adapter "a" updated twice (full, then a delta after a step), then "b" once: after each
    update every rank holds the engine's own load of the trainer's adapter, the other adapter
    is untouched, and each slot has its own version."""
    trainer = lora_model({"default": 41, "other": 42})
    rendezvous, ranks, slots = serving(engine, transport, f"{engine.name}-lora-{transport}-{tp}", tp)
    try:
        b_before = [engine.held(lora, "b") for lora in ranks]
        with Session(source=LoraSource(trainer, adapter="default"), transport=transport, rendezvous=rendezvous,
                     check=True, delta=True) as into_a:
            into_a.connect([f"{engine.name}/a"])
            for n, version in enumerate(("a-1", "a-2")):
                if n:
                    perturb_first_rows(trainer, "default", seed=n)
                report = into_a.update(version)
                delta_ranks = list(range(tp)) if n else []  # the first update is full
                assert report.ok and report.engines[f"{engine.name}/a"].delta_ranks == delta_ranks, report.format()
                assert_holds(engine, ranks, "a", own_load(engine, trainer, "default", tp))
                for lora, before in zip(ranks, b_before):
                    assert_bytes_equal(engine.held(lora, "b"), before, f"rank {lora.rank}: adapter 'b', untouched")
        with Session(source=LoraSource(trainer, adapter="other"), transport=transport, rendezvous=rendezvous) as into_b:
            into_b.connect([f"{engine.name}/b"])
            assert into_b.update("b-1").ok
        assert_holds(engine, ranks, "b", own_load(engine, trainer, "other", tp))
        assert_holds(engine, ranks, "a", own_load(engine, trainer, "default", tp))
        assert [(s.endpoints["a"].version, s.endpoints["b"].version) for s in slots] == [("a-2", "b-1")] * tp
    finally:
        for rank_slots in slots:
            rank_slots.close()
