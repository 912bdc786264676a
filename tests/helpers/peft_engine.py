"""A torch engine serving LoRA adapter slots of one PEFT model (a tiny Qwen3 with random base
weights), each slot an engine id of its own, for the LoRA tests; and how both sides build it."""

from __future__ import annotations

import threading
from typing import Any

import torch

from p2psync.worlds import ModelSpec, greedy
from p2psync.worlds.lora import adapter_bytes

#: Every adapter of these tests: LoRA on the attention's q and v projections.
TARGETS = ["q_proj", "v_proj"]
BASE_SEED = 1


def config_of(spec: dict[str, Any]) -> Any:
    """The PEFT LoraConfig of one adapter spec ({"r", "lora_alpha"}; random A and B)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.get("r", 4), lora_alpha=spec.get("lora_alpha", 8), target_modules=TARGETS,
                      lora_dropout=0.0, init_lora_weights=False)


def with_adapters(adapters: dict[str, dict[str, Any]]) -> Any:
    """The base model with a LoRA adapter per entry ({name: {"seed", "r", "lora_alpha"}}), each
    initialized at random (A and B both nonzero), in order."""
    from peft import get_peft_model

    model = None
    for name, spec in adapters.items():
        torch.manual_seed(spec["seed"])
        config = config_of(spec)
        if model is None:
            model = get_peft_model(ModelSpec().build(seed=BASE_SEED), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    return model.eval()


def adapter_state(model: Any, adapter: str) -> dict[str, torch.Tensor]:
    """`adapter`'s tensors as PEFT saves them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=adapter)


def generate_with(model: Any, adapter: str) -> list[int]:
    model.set_adapter(adapter)
    return greedy(model)


def lora_engine_process(
    port: int, job_id: str, transport: str, adapters: dict[str, dict[str, Any]], stop: Any, commands: Any = None,
    answers: Any = None,
) -> None:
    """Serve every adapter of `with_adapters(adapters)` as engine `lora/<adapter>` until `stop`
    is set. Each slot's routes: `state` (its tensors as PEFT saves them, hex) and `generate`
    (greedy with that adapter active). `commands` may ask ("load", name, spec) or ("unload",
    name) while it serves; each is answered on `answers` with the adapters the model then has."""
    import queue

    from p2psync.adapters.peft import AdapterSlots
    from p2psync.core.logs import configure
    from p2psync.core.rendezvous import Rendezvous
    from p2psync.engine.endpoint import EngineHooks

    configure("lora engine")
    torch.set_num_threads(1)
    model = with_adapters(adapters)
    slots = AdapterSlots(model, rendezvous=Rendezvous(host="127.0.0.1", port=port, job_id=job_id),
                         transport=transport, prefix="lora/")
    one_at_a_time = threading.Lock()  # PEFT's active adapter is the model's

    def hooks(adapter: str) -> EngineHooks:
        def state(body: dict[str, Any]) -> dict[str, str]:
            return adapter_bytes(model, adapter)

        def generate(body: dict[str, Any]) -> dict[str, list[int]]:
            with one_at_a_time, torch.no_grad():
                return {"tokens": generate_with(model, adapter)}

        return EngineHooks(routes={"state": state, "generate": generate})

    for adapter in adapters:
        slots.serve(adapter, hooks=hooks(adapter), version="initial")
    while commands is not None and not stop.is_set():
        try:
            command, name, *spec = commands.get(timeout=0.2)
        except queue.Empty:
            continue
        with one_at_a_time:
            if command == "load":
                torch.manual_seed(spec[0]["seed"])
                slots.load(name, config_of(spec[0]), hooks=hooks(name))
            else:
                slots.unload(name)
        answers.put(sorted(model.peft_config))
    stop.wait()
    slots.close()


#: Every linear projection of the worlds' models (engines stack q/k/v and gate/up).
ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def lora_model(adapters: dict[str, int], *, base: ModelSpec = ModelSpec(), r: int = 4,
               targets: list[str] = ALL_LINEAR, **config: Any) -> Any:
    """`base` (seed 1) with a random LoRA adapter per entry ({name: seed}), A and B nonzero."""
    from peft import LoraConfig, get_peft_model

    model = base.build(seed=1)
    for name, seed in adapters.items():
        torch.manual_seed(seed)  # after the base model's own seed
        lora = LoraConfig(r=r, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                          **config)
        if hasattr(model, "peft_config"):
            model.add_adapter(name, lora)
        else:
            model = get_peft_model(model, lora, adapter_name=name)
    return model.eval()


def peft_checkpoint(model: Any, adapter: str, dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`adapter`'s tensors as PEFT saves them, in `dtype` (as RL frameworks send them to an
    engine), and its `adapter_config.json` fields."""
    tensors = adapter_state(model, adapter)
    config = model.peft_config[adapter].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    return {n: t.detach().to(dtype) for n, t in tensors.items()}, config


def perturb_first_rows(model: Any, adapter: str, seed: int) -> None:
    """A change of the first row of each of `adapter`'s tensors (so that a delta moves less)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{adapter}." in name:
                p[:1].add_(torch.randn(p[:1].shape, generator=generator) * 0.05)


def assert_bytes_equal(got: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], what: str) -> None:
    """`got` holds exactly `wanted`'s tensors, byte for byte."""
    assert list(got) == list(wanted), what
    wrong = [n for n in wanted if not torch.equal(got[n].view(torch.uint8), wanted[n].view(torch.uint8))]
    assert not wrong, f"{what}: bytes differ in {wrong}"
