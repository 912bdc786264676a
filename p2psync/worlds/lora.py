"""The LoRA bench's engine: one process holding a model twice, whole (engine `full`, a torch
engine) and as a PEFT model with one LoRA adapter slot (engine `lora`), so that one run
updates the same model both ways. PEFT is imported here, inside the processes that need it."""

from __future__ import annotations

from typing import Any

#: The modules a bench adapter adapts: every linear projection of a Qwen3 decoder layer.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_adapter(config: dict[str, Any], *, seed: int, rank: int) -> Any:
    """The seed's Qwen3 of `config` with LoRA adapter "default" of `rank` (alpha 2 x rank) on
    TARGETS, its A and B both random."""
    import torch
    from peft import LoraConfig, get_peft_model

    from .models import ModelSpec

    model = ModelSpec("qwen3", config).build(seed=seed)
    torch.manual_seed(seed + 1)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, lora).eval()


def adapter_bytes(model: Any, adapter: str = "default") -> dict[str, str]:
    """`adapter` of a PEFT model as PEFT saves it: each tensor's bytes, hex."""
    import torch
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return {n: t.reshape(-1).view(torch.uint8).numpy().tobytes().hex() for n, t in state.items()}


def lora_bench_engine(port: int, job_id: str, transport: str, config: dict[str, Any], rank: int, stop: Any) -> None:
    """Serve the seed-1 model of `config` whole as engine `full` and with adapter "default" as
    engine `lora` (route `adapter`: its tensors as PEFT saves them, hex) until `stop` is set."""
    from ..adapters.peft import serve_lora
    from ..adapters.torch import serve
    from ..core.logs import configure
    from ..core.rendezvous import Rendezvous
    from ..engine.endpoint import EngineHooks
    from .models import ModelSpec

    configure("lora bench engine")
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=job_id)
    whole = ModelSpec("qwen3", config).build(seed=1)
    adapted = with_adapter(config, seed=1, rank=rank)

    endpoints = [
        serve(whole, engine_id="full", rendezvous=rendezvous, transport=transport),
        serve_lora(adapted, adapter="default", engine_id="lora", rendezvous=rendezvous, transport=transport,
                   hooks=EngineHooks(routes={"adapter": lambda body: adapter_bytes(adapted)})),
    ]
    stop.wait()
    for endpoint in endpoints:
        endpoint.close()
