"""LoRA adapter updates into vLLM's own LoRA machinery (tox env conformance-vllm): every TP rank
(TP 1 and 2) of a tiny Qwen3 in bfloat16 built on CPU with vLLM's worker LoRA manager, two
adapters loaded by vLLM's own loader and served as p2psync adapter slots in this process. After
every update each rank holds exactly what vLLM's own load of the trainer's adapter leaves there:
the host copy (q/k/v and gate/up packed, the scaling in B) and the rank's TP slice in the
adapter's slot of every LoRA layer's stacked buffers; the other adapter is untouched."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (p2psync[vllm], vllm==0.33.0) is not installed; run `tox -e conformance-vllm`")
peft = pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")

import torch  # noqa: E402

from p2psync import ConnectError, Rendezvous, Session  # noqa: E402
from p2psync.adapters.peft import LoraSource  # noqa: E402
from p2psync.adapters.vllm import LoraSettings, VllmAdapterSlots, lora_rank  # noqa: E402
from p2psync.adapters.vllm.lora_shim import adapter, add, host_weights, slot_buffers, slot_of  # noqa: E402
from p2psync.worlds import ModelSpec  # noqa: E402
from tests.helpers.matrix import TRANSPORTS, usable  # noqa: E402
from tests.helpers.lora_slots import SlotEngine, check_two_adapters_updated_independently, serving  # noqa: E402
from tests.helpers.peft_engine import lora_model, peft_checkpoint  # noqa: E402

SETTINGS = LoraSettings(max_lora_rank=8, max_loras=2, max_cpu_loras=3)
MODEL = ModelSpec()


def engine_ranks(tp: int) -> list[Any]:
    return [lora_rank(MODEL.config_dict(), SETTINGS, tp=tp, rank=r) for r in range(tp)]


def held(lora: Any, name: str) -> dict[str, torch.Tensor]:
    adapter_id = lora.ids[name]
    slot = slot_of(lora.worker, lora.vllm_config, lora.rank, adapter_id)
    return {**{f"host {n}": t.clone() for n, t in host_weights(adapter(lora.worker, adapter_id)).items()},
            **{f"slot {n}": t.clone() for n, t in slot_buffers(lora.worker, slot).items()}}


def own_load(lora: Any, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    add(lora.worker, lora.vllm_config, lora.rank, 1, tensors, config)  # vLLM's from_lora_tensors and add_adapter
    lora.ids[name] = 1


def slots(lora: Any, rendezvous: Rendezvous, transport: str) -> VllmAdapterSlots:
    return VllmAdapterSlots(lora, rendezvous=rendezvous, transport=transport, prefix="vllm/")


VLLM = SlotEngine(name="vllm", ranks=engine_ranks, slots=slots, held=held, own_load=own_load)


@pytest.mark.parametrize(("transport", "tp"), [
    pytest.param(t, 2, marks=pytest.mark.conformance(trainer="fsdp2", engine="vllm", transport=t, via="peft lora"))
    for t in TRANSPORTS
] + [pytest.param("mooncake", 1, marks=pytest.mark.conformance(trainer="fsdp2", engine="vllm", transport="mooncake",
                                                                via="peft lora, TP 1"))])
def test_two_adapters_of_vllm_ranks_are_updated_independently_bit_exact_with_vllms_own_load(transport, tp):
    usable("transports", transport)
    check_two_adapters_updated_independently(VLLM, transport, tp)


def test_what_vllm_would_serve_otherwise_is_refused_naming_engine_rank_and_adapter():
    rendezvous, ranks, slots = serving(VLLM, "samehost", "vllm-lora-refusals")
    try:
        with pytest.raises(ValueError, match=r"rank 0: vLLM refused LoRA adapter 'wide': .*rank"):
            slots[0].load("wide", *peft_checkpoint(lora_model({"wide": 51}, r=16), "wide"))  # above --max-lora-rank
        with pytest.raises(ValueError, match=r"rank 0: vLLM refused LoRA adapter 'dora': .*DoRA"):
            slots[0].load("dora", *peft_checkpoint(lora_model({"dora": 57}, use_dora=True), "dora"))
        slots[0].load("c", *peft_checkpoint(lora_model({"c": 52}), "c"))
        with pytest.raises(ValueError, match=r"rank 0: cannot load LoRA adapter 'd': the engine holds 3 adapters"):
            slots[0].load("d", *peft_checkpoint(lora_model({"d": 53}), "d"))
        before = [held(lora, "a") for lora in ranks]
        with Session(source=LoraSource(lora_model({"default": 53}, r=8)), transport="samehost",
                     rendezvous=rendezvous) as session:
            with pytest.raises(ConnectError, match=r"engine 'vllm/a' rank 0: its LoRA adapter slot 'a' does not "
                                                   r"match the trainer's adapter 'default': r 4 there, 8 here"):
                session.connect(["vllm/a"])
        for lora, wanted in zip(ranks, before):  # nothing written
            got = held(lora, "a")
            assert all(torch.equal(t, got[k]) for k, t in wanted.items())
    finally:
        for rank_slots in slots:
            rank_slots.close()
