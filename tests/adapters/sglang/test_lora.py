"""LoRA adapter updates into sglang's own LoRA machinery (tox env conformance-sglang): every TP
rank (TP 1 and 2) of a tiny Qwen3 in bfloat16 built on CPU with sglang's LoRAManager, two adapters loaded
by sglang's own loader and served as p2psync adapter slots in this process. After every
update each rank holds exactly what sglang's own `load_lora_adapter_from_tensors` of the
trainer's adapter leaves there: the host copy (q/k/v and gate/up stacked) and the rank's TP
slice in the adapter's pool slot; the other adapter is untouched."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (tox env conformance-sglang)")
peft = pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")

import torch  # noqa: E402

from p2psync import ConnectError, Rendezvous, Session  # noqa: E402
from p2psync.adapters.peft import LoraSource  # noqa: E402
from p2psync.adapters.sglang import LoraSettings, SglangAdapterSlots, lora_rank  # noqa: E402
from p2psync.adapters.sglang.lora_shim import host_weights, load_from_tensors, lora_id, slot_buffers, slot_of  # noqa: E402
from p2psync.worlds import ModelSpec  # noqa: E402
from tests.helpers.matrix import TRANSPORTS, usable  # noqa: E402
from tests.helpers.peft_engine import assert_bytes_equal, perturb_first_rows, ALL_LINEAR, lora_model, peft_checkpoint  # noqa: E402

SETTINGS = LoraSettings(max_lora_rank=8, target_modules=tuple(ALL_LINEAR), max_loras_per_batch=3,
                        max_loaded_loras=3)
MODEL = ModelSpec()


def engine_ranks(tp: int) -> list[Any]:
    return [lora_rank(MODEL.config_dict(), SETTINGS, tp=tp, rank=r) for r in range(tp)]


def held(lora: Any, uid: str) -> dict[str, torch.Tensor]:
    """The adapter's bytes on one rank: its host copy, and its pool slot (sglang loading it there
    first where it holds none, as a batch using it would)."""
    slot = slot_of(lora.rank_model, lora.manager, uid)
    return {**{f"host {n}": t.clone() for n, t in host_weights(lora.manager, uid).items()},
            **{f"pool {n}": t.clone() for n, t in slot_buffers(lora.manager, slot).items()}}


def own_load(model: Any, adapter: str, tp: int) -> list[dict[str, torch.Tensor]]:
    """Per TP rank, what sglang's own load of the trainer's `adapter` leaves there."""
    wanted = []
    for lora in engine_ranks(tp):
        uid = load_from_tensors(lora.rank_model, lora.manager, adapter, *peft_checkpoint(model, adapter))
        wanted.append(held(lora, uid))
    return wanted


def assert_holds(ranks: list[Any], adapter: str, wanted: list[dict[str, torch.Tensor]]) -> None:
    for lora, expected in zip(ranks, wanted):
        got = held(lora, lora_id(lora.manager, adapter))
        assert_bytes_equal(got, expected, f"rank {lora.rank}: adapter {adapter!r}, against sglang's own load")


def serving(transport: str, job: str, tp: int = 2) -> tuple[Rendezvous, list[Any], list[SglangAdapterSlots]]:
    """Every TP rank, each holding adapters "a" and "b" (sglang's own load of other random
    weights than the trainer's), served as slots `sglang/a` and `sglang/b`; "a" already in a
    pool slot (a batch used it), "b" not yet."""
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id=job, is_server=True, timeout=60)
    engine = lora_model({"a": 31, "b": 32})
    ranks, slots = engine_ranks(tp), []
    for lora in ranks:
        rank_slots = SglangAdapterSlots(lora, rendezvous=rendezvous, transport=transport, prefix="sglang/")
        for adapter in ("a", "b"):
            rank_slots.load(adapter, *peft_checkpoint(engine, adapter))
        slot_of(lora.rank_model, lora.manager, lora_id(lora.manager, "a"))
        slots.append(rank_slots)
    return rendezvous, ranks, slots


@pytest.mark.parametrize(("transport", "tp"), [
    pytest.param(t, 2, marks=pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport=t, via="peft lora"))
    for t in TRANSPORTS
] + [pytest.param("mooncake", 1, marks=pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake",
                                                                via="peft lora, TP 1"))])
def test_two_adapters_of_sglang_ranks_are_updated_independently_bit_exact_with_sglangs_own_load(transport, tp):
    usable("transports", transport)
    trainer = lora_model({"default": 41, "other": 42})
    rendezvous, ranks, slots = serving(transport, f"sglang-lora-{transport}-{tp}", tp)
    try:
        b_before = [held(lora, lora_id(lora.manager, "b")) for lora in ranks]
        with Session(source=LoraSource(trainer, adapter="default"), transport=transport, rendezvous=rendezvous,
                     check=True, delta=True) as into_a:
            into_a.connect(["sglang/a"])
            for n, version in enumerate(("a-1", "a-2")):
                if n:
                    perturb_first_rows(trainer, "default", seed=n)
                report = into_a.update(version)
                assert report.ok and report.engines["sglang/a"].delta_ranks == (list(range(tp)) if n else []), report.format()
                assert_holds(ranks, "a", own_load(trainer, "default", tp))
                for lora, before in zip(ranks, b_before):  # the other adapter untouched
                    assert all(torch.equal(t, held(lora, lora_id(lora.manager, "b"))[n]) for n, t in before.items())
        with Session(source=LoraSource(trainer, adapter="other"), transport=transport, rendezvous=rendezvous) as into_b:
            into_b.connect(["sglang/b"])
            assert into_b.update("b-1").ok
        assert_holds(ranks, "b", own_load(trainer, "other", tp))
        assert_holds(ranks, "a", own_load(trainer, "default", tp))
        assert [(s.endpoints["a"].version, s.endpoints["b"].version) for s in slots] == [("a-2", "b-1")] * tp
    finally:
        for rank_slots in slots:
            rank_slots.close()


def test_what_sglang_would_serve_otherwise_is_refused_naming_engine_rank_and_adapter():
    rendezvous, ranks, slots = serving("samehost", "sglang-lora-refusals")
    try:
        wide = lora_model({"wide": 51}, r=16)  # above --max-lora-rank 8
        with pytest.raises(ValueError, match=r"rank 0: sglang refused LoRA adapter 'wide': .*rank 16 is incompatible"):
            slots[0].load("wide", *peft_checkpoint(wide, "wide"))
        head = lora_model({"head": 56}, targets=["lm_head", "q_proj"])  # outside --lora-target-modules
        with pytest.raises(ValueError, match=r"rank 0: sglang refused LoRA adapter 'head': .*--lora-target-modules"):
            slots[0].load("head", *peft_checkpoint(head, "head"))
        slots[0].load("c", *peft_checkpoint(lora_model({"c": 52}), "c"))
        with pytest.raises(ValueError, match=r"rank 0: cannot load LoRA adapter 'd': the engine holds 3 adapters"):
            slots[0].load("d", *peft_checkpoint(lora_model({"d": 53}), "d"))
        before = [held(lora, lora_id(lora.manager, "a")) for lora in ranks]
        other_rank = lora_model({"default": 53}, r=8)
        with Session(source=LoraSource(other_rank), transport="samehost", rendezvous=rendezvous) as session:
            with pytest.raises(ConnectError, match=r"engine 'sglang/a' rank 0: its LoRA adapter slot 'a' does not "
                                                   r"match the trainer's adapter 'default': r 4 there, 8 here"):
                session.connect(["sglang/a"])
        slots[0].unload("c")
        for rank_slots in slots:
            rank_slots.unload("b")
            rank_slots.load("rs", *peft_checkpoint(lora_model({"rs": 54}, use_rslora=True), "rs"))  # sglang loads it
        with Session(source=LoraSource(lora_model({"default": 55}, use_rslora=True)), transport="samehost",
                     rendezvous=rendezvous) as session:
            with pytest.raises(ConnectError, match=r"engine 'sglang/rs' rank 0: LoRA adapter 'rs': sglang scales"):
                session.connect(["sglang/rs"])
        for lora, wanted in zip(ranks, before):  # nothing written
            got = held(lora, lora_id(lora.manager, "a"))
            assert all(torch.equal(t, got[n]) for n, t in wanted.items())
    finally:
        for rank_slots in slots:
            rank_slots.close()
