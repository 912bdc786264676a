"""Merge mode: a PEFT model's base weights with its adapter merged in, into a plain torch engine
holding the base model (no LoRA). After each update the engine holds, bit for bit, the state
dict PEFT's own `merge_and_unload()` makes of the trainer's model, and generates what it does."""

from __future__ import annotations

import copy

import pytest

peft = pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")

import torch  # noqa: E402

from p2psync import Rendezvous, Session  # noqa: E402
from p2psync.adapters.peft import MergedLoraSource  # noqa: E402
from p2psync.adapters.torch import serve  # noqa: E402
from p2psync.worlds import ModelSpec, greedy  # noqa: E402
from tests.helpers.matrix import usable  # noqa: E402
from tests.helpers.peft_engine import with_adapters  # noqa: E402

#: The trainer's adapters (random A and B); "other" is merged.
TRAINER = {"default": {"seed": 21}, "other": {"seed": 22}}


def merged(model: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """PEFT's own merge of `adapter` into a copy of the trainer's model."""
    copied = copy.deepcopy(model)
    copied.set_adapter(adapter)
    return copied.merge_and_unload().state_dict()


@pytest.mark.parametrize("transport", [
    pytest.param(t, marks=pytest.mark.conformance(trainer="fsdp2", engine="torch", transport=t, via="peft merged"))
    for t in ("mooncake", "samehost")
])
def test_merged_base_weights_land_as_peft_merge_and_unload_makes_them(transport):
    usable("transports", transport)
    trainer = with_adapters(TRAINER)
    engine = ModelSpec().build(seed=7)  # other base weights than the trainer's
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id=f"merged-{transport}", is_server=True, timeout=30)
    endpoint = serve(engine, engine_id="plain", rendezvous=rendezvous, transport=transport)
    try:
        with Session(source=MergedLoraSource(trainer, adapter="other"), transport=transport, rendezvous=rendezvous,
                     check=True) as session:
            session.connect(["plain"])
            for version in ("m-1", "m-2"):
                if version == "m-2":
                    with torch.no_grad():
                        for name, p in trainer.named_parameters():
                            if ".other." in name:
                                p.mul_(1.5)
                report = session.update(version)
                assert report.ok, report.format()
                wanted = merged(trainer, "other")
                held = engine.state_dict()
                assert list(held) == list(wanted)
                wrong = [n for n in wanted if not torch.equal(held[n], wanted[n])]
                assert not wrong, f"bytes differ from PEFT's merge in {wrong}"
        unmerged = dict(ModelSpec().build(seed=1).state_dict())  # the trainer's base, no adapter
        assert not torch.equal(held["model.layers.0.self_attn.q_proj.weight"],
                               unmerged["model.layers.0.self_attn.q_proj.weight"])  # the adapter is in it
        assert torch.equal(held["model.layers.0.self_attn.k_proj.weight"],
                           unmerged["model.layers.0.self_attn.k_proj.weight"])  # an untargeted weight as it was
        reference = ModelSpec().build(seed=7)
        reference.load_state_dict(wanted)
        assert greedy(engine) == greedy(reference)
    finally:
        endpoint.close()


def test_what_merge_mode_cannot_merge_is_refused_naming_the_adapter():
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(ModelSpec().build(seed=1), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="LoRA adapter 'default' is DoRA: merge mode merges plain LoRA only"):
        MergedLoraSource(dora)
    with pytest.raises(ValueError, match=r"the model has no LoRA adapter 'nope'"):
        MergedLoraSource(with_adapters(TRAINER), adapter="nope")
