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
from tests.helpers.lora_slots import SlotEngine, check_two_adapters_updated_independently, serving  # noqa: E402
from tests.helpers.peft_engine import ALL_LINEAR, lora_model, peft_checkpoint  # noqa: E402

SETTINGS = LoraSettings(max_lora_rank=8, target_modules=tuple(ALL_LINEAR), max_loras_per_batch=3,
                        max_loaded_loras=3)
MODEL = ModelSpec()


def engine_ranks(tp: int) -> list[Any]:
    return [lora_rank(MODEL.config_dict(), SETTINGS, tp=tp, rank=r) for r in range(tp)]


def held(lora: Any, adapter: str) -> dict[str, torch.Tensor]:
    uid = lora_id(lora.manager, adapter)
    slot = slot_of(lora.rank_model, lora.manager, uid)
    return {**{f"host {n}": t.clone() for n, t in host_weights(lora.manager, uid).items()},
            **{f"pool {n}": t.clone() for n, t in slot_buffers(lora.manager, slot).items()}}


def own_load(lora: Any, adapter: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    load_from_tensors(lora.rank_model, lora.manager, adapter, tensors, config)  # sglang's load_lora_adapter_from_tensors


def slots(lora: Any, rendezvous: Rendezvous, transport: str) -> SglangAdapterSlots:
    return SglangAdapterSlots(lora, rendezvous=rendezvous, transport=transport, prefix="sglang/")


SGLANG = SlotEngine(name="sglang", ranks=engine_ranks, slots=slots, held=held, own_load=own_load)


@pytest.mark.parametrize(("transport", "tp"), [
    pytest.param(t, 2, marks=pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport=t, via="peft lora"))
    for t in TRANSPORTS
] + [pytest.param("mooncake", 1, marks=pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake",
                                                                via="peft lora, TP 1"))])
def test_two_adapters_of_sglang_ranks_are_updated_independently_bit_exact_with_sglangs_own_load(transport, tp):
    usable("transports", transport)
    check_two_adapters_updated_independently(SGLANG, transport, tp)


def test_what_sglang_would_serve_otherwise_is_refused_naming_engine_rank_and_adapter():
    rendezvous, ranks, slots = serving(SGLANG, "samehost", "sglang-lora-refusals")
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
        before = [held(lora, "a") for lora in ranks]
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
            got = held(lora, "a")
            assert all(torch.equal(t, got[n]) for n, t in wanted.items())
    finally:
        for rank_slots in slots:
            rank_slots.close()
